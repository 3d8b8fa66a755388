"""Anthropic's Messages API, `POST /v1/messages` and `POST /v1/messages/count_tokens`, as a chat
completion upstream: any executor that speaks chat completions serves it, governed like any chat
call (calls.py). The official SDK works unchanged with `base_url` set to the server's root
(it adds `/v1/messages`); the token goes in `x-api-key` (as the SDK sends it) or
`Authorization: Bearer`. Errors are Anthropic's shape,
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, with our code
beside them (`error.code`) and the status codes the SDK maps to its exceptions.

| Messages request | chat completion | notes |
| --- | --- | --- |
| `model`, `max_tokens` (required), `temperature`, `top_p` | the same | |
| `system` (a string or text blocks) | a `system` message first | |
| `messages`: `user` / `assistant`, content a string or blocks | messages | |
| `text` blocks | text (several join into one string) | `cache_control`, `citations` on a block: accepted, no effect (hints) |
| `image` blocks (`base64` or `url` source) | `image_url` parts (base64 as a data URL) | `file` sources: 400 (no file store) |
| `tool_use` blocks (assistant) | `tool_calls` (`input` → JSON `arguments`) | |
| `tool_result` blocks (user) | `tool` messages, before the user's other content; text blocks joined | `is_error: true` prefixes the content with `[tool error] ` (chat completions has no such flag); images in a result: 400 |
| `tools` (`name`, `description`, `input_schema`) | function `tools` | Anthropic's typed tools (bash, text editor, web search, computer, ...): 400, they run at Anthropic |
| `tool_choice` auto / any / tool / none | auto / required / the function / none | `disable_parallel_tool_use: true` → `parallel_tool_calls: false` |
| `stop_sequences` | `stop` | |
| `metadata.user_id` | `user` | |
| `output_config.format` (or `output_format`) json_schema | `response_format` json_schema | `output_config.effort`: 400 |
| `stream: true` | a streamed job | Anthropic's events (below) |
| `thinking` disabled, `service_tier` auto / standard_only, `cache_control` | accepted | the defaults, or hints that change no answer |
| `thinking` enabled / adaptive, `top_k`, `thinking` / `redacted_thinking` / `document` / server tool blocks, any other field | 400 naming the field | chat completions cannot carry them |

The answer is a `message`: a `text` block (when the model wrote text), then a `tool_use` block
per tool call; `stop_reason` from the finish reason (stop → `end_turn`, length → `max_tokens`,
tool_calls → `tool_use`, content_filter → `refusal`; chat completions do not say which stop
sequence matched, so a stop sequence reads as `end_turn`); `usage` in input and output tokens.
Streamed: `message_start` (its `input_tokens` the prompt as counted for the budget estimate),
`ping`, `content_block_start` / `content_block_delta` (`text_delta`, or a tool call's
`input_json_delta`, as the model writes) / `content_block_stop` per block, `message_delta`
(stop reason, and the usage the model server reported), `message_stop`; a failure after the
stream started is an `error` event. `count_tokens` answers `{"input_tokens": N}` by the same
stand-in count the budget estimate uses (executors/tokens.py), without a job."""  # noqa: E501 (the mapping table's rows)

import json
from typing import Any

from executors.selectors import models_usable_by
from executors.tokens import count_prompt_tokens
from scheduler.gateway import shapes
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.calls import (
    INTERRUPTED,
    TEAM_HEADER,
    Dialect,
    GatewayError,
    StreamWriter,
    answering_errors,
    caller_for,
    model_call,
    renamed,
    respond_error,
    sse,
)
from scheduler.gateway.database import db
from scheduler.gateway.feed import ToolPiece

KNOWN = (
    "model",
    "max_tokens",
    "messages",
    "system",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "stop_sequences",
    "metadata",
    "stream",
    "thinking",
    "service_tier",
    "cache_control",
    "output_config",
    "output_format",
)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def anthropic_error(error: GatewayError) -> dict[str, Any]:
    """Anthropic's error shape; `code` is the gateway's own, the same as in OpenAI's shape."""
    detail = {"type": error_type(error.status), "message": error.message, "code": error.code}
    if error.param:
        detail["param"] = error.param
    return {"type": "error", "error": detail}


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return anthropic_error(shapes.OpenAIError(status, message, code=code))


def refused(field: str, why: str) -> GatewayError:
    return shapes.OpenAIError(400, f"{field}: not supported: {why}", code="unsupported_parameter", param=field)


# --- the request ---------------------------------------------------------------------------------


def translate(body: Any, *, counting: bool = False) -> shapes.ModelCall:
    """A Messages request as a chat completions job (the table in the module docstring). For
    `count_tokens` (`counting`), `max_tokens` is not asked for."""
    body = shapes._object(body)
    for name in body:
        if name not in KNOWN and body[name] is not None:
            raise refused(name, "this gateway serves the Messages API over chat completions, which has no such option.")
    chat: dict[str, Any] = {"model": shapes._model(body)}
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        raise shapes.bad_request("max_tokens: Field required", "max_tokens")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    chat["messages"] = _system(body.get("system")) + messages(body.get("messages"))
    for name in ("temperature", "top_p", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise shapes.bad_request("stop_sequences: must be a list of non-empty strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    if body.get("tools") is not None:
        chat["tools"] = tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(tool_choice(body["tool_choice"]))
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise shapes.bad_request("metadata: only user_id is accepted", "metadata")
        if metadata.get("user_id") is not None:
            chat["user"] = str(metadata["user_id"])
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise refused("thinking", "extended thinking has no counterpart in chat completions.")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise shapes.bad_request("service_tier: must be auto or standard_only", "service_tier")
    response_format = _output_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        call = shapes.chat_call(chat)
    except shapes.OpenAIError as exc:
        raise renamed(exc, {"stop": "stop_sequences"}) from None
    prompt = count_prompt_tokens(chat["messages"])
    return shapes.ModelCall(
        model=call.model, input=call.input, est_tokens=call.est_tokens, stream=call.stream, context={"prompt": prompt}
    )


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))}]
    raise shapes.bad_request("system: must be a string or a list of text blocks", "system")


def _text_block(block: Any, where: str) -> str:
    if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
        raise refused(f"{where}.type", "only text blocks are taken here.")
    return block["text"]


def messages(value: Any) -> list[dict[str, Any]]:
    """Anthropic's messages as chat messages."""
    if not isinstance(value, list) or not value:
        raise shapes.bad_request("messages: must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise shapes.bad_request(f"{where}: must be an object", where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise shapes.bad_request(f"{where}.role: must be user or assistant", f"{where}.role")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif isinstance(content, list):
            chat += _user(content, where) if role == "user" else [_assistant(content, where)]
        else:
            raise shapes.bad_request(f"{where}.content: must be a string or a list of blocks", f"{where}.content")
    return chat


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as `tool` messages, then its own content."""
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), at)}})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise shapes.bad_request(f"{at}.tool_use_id: must be a string", f"{at}.tool_use_id")
            text = _result_text(block.get("content"), f"{at}.content")
            if block.get("is_error"):
                text = "[tool error] " + text
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise refused(f"{at}.type", f"{kind!r} blocks are not supported over chat completions.")
    if not parts:
        return results
    if all(part["type"] == "text" for part in parts):
        return [*results, {"role": "user", "content": "".join(part["text"] for part in parts)}]
    return [*results, {"role": "user", "content": parts}]


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise shapes.bad_request(f"{at}: a tool_use block needs an id and a name", at)
            if not isinstance(block.get("input"), dict):
                raise shapes.bad_request(f"{at}.input: must be an object", f"{at}.input")
            arguments = json.dumps(block["input"])
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        else:
            raise refused(f"{at}.type", f"{kind!r} blocks are not supported over chat completions.")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _image_url(source: Any, where: str) -> str:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise refused(f"{where}.source", "images are taken as base64 or url sources only: there is no file store here.")


def _result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_block(block, f"{where}[{i}]") for i, block in enumerate(content))
    raise shapes.bad_request(f"{where}: must be a string or a list of text blocks", where)


def tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise shapes.bad_request("tools: must be a list", "tools")
    chat = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise shapes.bad_request(f"{where}: must be an object", where)
        if tool.get("type") not in (None, "custom"):
            raise refused(f"{where}.type", f"{tool.get('type')!r} tools run at Anthropic; only custom tools run here.")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise shapes.bad_request(f"{where}.name: Field required", f"{where}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise shapes.bad_request(f"{where}.input_schema: Field required", f"{where}.input_schema")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        chat.append({"type": "function", "function": function})
    return chat


def tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    options: dict[str, Any] = {}
    if kind == "auto":
        options["tool_choice"] = "auto"
    elif kind == "any":
        options["tool_choice"] = "required"
    elif kind == "none":
        options["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        options["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise shapes.bad_request("tool_choice: must be auto, any, tool (with a name) or none", "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        options["parallel_tool_calls"] = False
    return options


def _output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise shapes.bad_request("output_config: must be an object", "output_config")
    if config and config.get("effort") is not None:
        raise refused("output_config.effort", "chat completions carry no effort setting.")
    fmt = body.get("output_format") or (config or {}).get("format")
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise shapes.bad_request("output_config.format: must be {type: json_schema, schema: {...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


# --- the answer ----------------------------------------------------------------------------------


def message_id(job_id: int) -> str:
    return f"msg_{job_id}"


def content_blocks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply as content blocks: its text, then a `tool_use` block per tool call."""
    message = result.get("message") or {}
    text = str(message.get("content") or "")
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": function.get("name") or "",
                "input": _input(function),
            }
        )
    return blocks


def _input(function: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` is; a model that wrote something
    else has failed to call the tool, and the call says so (502) rather than inventing an input."""
    try:
        value = json.loads(function.get("arguments") or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise shapes.OpenAIError(
            502,
            f"The model called {function.get('name')!r} with arguments that are not a JSON object.",
            type="api_error",
            code="invalid_tool_call",
            retry=False,
        )
    return value


def _usage(result: dict[str, Any]) -> dict[str, int]:
    used = shapes.usage(result)
    return {
        "input_tokens": used["prompt_tokens"],
        "output_tokens": used["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_object(*, job_id: int, call: shapes.ModelCall, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": message_id(job_id),
        "type": "message",
        "role": "assistant",
        "model": result.get("model") or call.model,
        "content": content_blocks(result),
        "stop_reason": STOP_REASONS.get(result.get("finish_reason") or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": _usage(result),
    }


class MessagesWriter(StreamWriter):
    """Anthropic's stream: `message_start`, content blocks one after the other as they come (the
    text, a `tool_use` block per tool call, each stopped when the next starts), `message_delta`,
    `message_stop`."""

    keepalive = sse({"type": "ping"}, event="ping")

    def __init__(self, *, job_id: int, created: int, call: shapes.ModelCall) -> None:
        super().__init__()
        self.job_id, self.call = job_id, call
        self.blocks: list[int | None] = []  # by block index: None a text block, else a tool call's index
        self.open = False  # whether the last block is still open

    def opening(self, text: str) -> bytes:
        start: dict[str, Any] = {
            "id": message_id(self.job_id),
            "type": "message",
            "role": "assistant",
            "model": self.call.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.call.context.get("prompt", 0), "output_tokens": 0},
        }
        return (
            sse({"type": "message_start", "message": start}, event="message_start")
            + self.keepalive
            + (self.text(text) if text else b"")
        )

    def _start(self, tool: int | None, block: dict[str, Any]) -> bytes:
        out = self._stop()
        self.blocks.append(tool)
        self.open = True
        data = {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}
        return out + sse(data, event="content_block_start")

    def _stop(self) -> bytes:
        if not self.open:
            return b""
        self.open = False
        return sse({"type": "content_block_stop", "index": len(self.blocks) - 1}, event="content_block_stop")

    def _current(self, tool: int | None) -> bool:
        return self.open and self.blocks[-1] == tool

    def _delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
        return sse(data, event="content_block_delta")

    def text(self, text: str) -> bytes:
        out = b"" if self._current(None) else self._start(None, {"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def tool_piece(self, piece: ToolPiece) -> bytes | None:
        out = b""
        if piece.first:
            out = self._start(piece.index, {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
        elif not self._current(piece.index):
            # A piece of a call whose block another block has closed: it cannot be sent in order.
            # `closing` finds it unsent, and ends the stream rather than send a wrong input.
            return None
        if not piece.text:
            return out
        return out + self._delta({"type": "input_json_delta", "partial_json": piece.text})

    def closing(self, result: dict[str, Any], rest: str) -> bytes:
        content_blocks(result)  # before anything is written: it refuses tool inputs that are not objects
        rests = self.tool_rests(result)
        out = [self.text(rest)] if rest else []
        for index, call, left in rests:
            function = call.get("function") or {}
            if left is None:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.get("id") or "",
                    "name": function.get("name") or "",
                    "input": {},
                }
                out.append(self._start(index, block))
                left = str(function.get("arguments") or "")
            elif left and not self._current(index):
                raise INTERRUPTED
            if left:
                out.append(self._delta({"type": "input_json_delta", "partial_json": left}))
        out.append(self._stop())
        final = message_object(job_id=self.job_id, call=self.call, result=result)
        out += [
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": final["stop_reason"], "stop_sequence": None},
                    "usage": final["usage"],
                },
                event="message_delta",
            ),
            sse({"type": "message_stop"}, event="message_stop"),
        ]
        return b"".join(out)

    def failure(self, error: GatewayError) -> bytes:
        return sse(anthropic_error(error), event="error")


class MessagesDialect(Dialect):
    via = "anthropic"
    api_key_header = "x-api-key"

    def translate(self, body: Any) -> shapes.ModelCall:
        return translate(body)

    def answer(self, *, job_id: int, created: int, call: shapes.ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return message_object(job_id=job_id, call=call, result=result)

    def writer(self, *, job_id: int, created: int, call: shapes.ModelCall) -> StreamWriter:
        return MessagesWriter(job_id=job_id, created=created, call=call)

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        return anthropic_error(error)

    def late_error(self, error: GatewayError) -> bytes:
        return sse(anthropic_error(error), event="error")


MESSAGES = MessagesDialect()


async def serve(request: Request, reply: Reply, rest: str | None = None) -> None:
    """Route /v1/messages and /v1/messages/count_tokens; every error leaves in Anthropic's shape."""
    routes = {"": create, "/count_tokens": count_tokens}
    handler = routes.get((rest or "").rstrip("/"))
    if handler is None:
        error = shapes.OpenAIError(404, f"Unknown path: {request.method} {request.path}", code="unknown_url")
        return await respond_error(reply, MESSAGES, error)
    if request.method != "POST":
        error = shapes.OpenAIError(
            405, f"{request.method} is not allowed on {request.path}; use POST.", code="method_not_allowed"
        )
        return await respond_error(reply, MESSAGES, error)
    await answering_errors(reply, MESSAGES, handler(request, reply))


async def create(request: Request, reply: Reply) -> None:
    """POST /v1/messages."""
    await model_call(request, reply, dialect=MESSAGES)


async def count_tokens(request: Request, reply: Reply) -> None:
    """POST /v1/messages/count_tokens: the prompt's tokens by the budget estimate's count; no job."""
    counted = await db(
        _count, authorization=MESSAGES.authorization(request), team=request.header(TEAM_HEADER), body=request.body
    )
    await reply.json(200, {"input_tokens": counted})


def _count(*, authorization: str | None, team: str | None, body: bytes) -> int:
    caller = caller_for(authorization=authorization, team=team, confirm=True)
    call = translate(shapes.parse_body(body), counting=True)
    if call.model not in models_usable_by([caller.team.pk], chat=True)[caller.team.pk]:
        raise shapes.OpenAIError(
            404, f"The model {call.model!r} does not exist or your team may not use it.", code="model_not_found"
        )
    return int(call.context["prompt"])
