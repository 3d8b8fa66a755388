"""OpenAI's Responses API, `POST /v1/responses`, as a chat completion upstream: any executor that
speaks chat completions serves it, governed like any chat call (calls.py). Stateless: nothing
is kept after the answer, so whatever needs a stored response or conversation is refused.

| Responses request | chat completion | notes |
| --- | --- | --- |
| `model` | `model` | |
| `input` (string) | one `user` message | |
| `input` message items (`role` user / assistant / system / developer, `content` a string or `input_text`, `output_text`, `refusal`, `input_image` with `image_url` parts) | messages; `developer` becomes `system` (local model servers know no `developer` role); text parts are joined, images become `image_url` parts | `input_image` by `file_id`, `input_file`, `input_audio`: 400 (no file store) |
| `function_call` items | `tool_calls` of an assistant message (consecutive calls, and the text just before them, make one message) | |
| `function_call_output` items | `tool` messages (`call_id` → `tool_call_id`; text parts joined) | images in an output: 400 |
| `instructions` | a `system` message first | |
| `tools` of `type: function` (`name`, `description`, `parameters`, `strict`) | `tools` | other tool types (web search, file search, computer, MCP, custom, ...): 400, they run at OpenAI |
| `tool_choice` none / auto / required / `{"type": "function", "name"}` | the same in chat's shape | hosted-tool and `allowed_tools` choices: 400 |
| `parallel_tool_calls`, `temperature`, `top_p`, `user` | the same | |
| `max_output_tokens` | `max_tokens` | |
| `text.format` text / json_object / json_schema | `response_format` | `text.verbosity`: 400 (no such control upstream) |
| `stream: true` | a streamed job | Responses events (below) |
| `metadata` | echoed in the response | kept in no store |
| `store` false or absent, `include` empty, `truncation` disabled, `background` false, `service_tier` auto / default, `reasoning` empty, `stream_options`, `prompt_cache_key`, `prompt_cache_retention`, `safety_identifier` | accepted | hints that change no answer, or the defaults; the response says `store: false` |
| `store: true` | 400 | responses are not kept: nothing could be retrieved later |
| `previous_response_id`, `conversation`, `item_reference` items | 400 | responses are not kept: send the whole conversation in `input` |
| `reasoning` with an effort or summary, `reasoning` items | 400 | chat completions carry no reasoning; we never return reasoning items |
| `include` non-empty, `top_logprobs`, `max_tool_calls`, `prompt`, `truncation: auto`, `background: true`, other service tiers, any other field | 400 naming the field | what they ask cannot be done over chat completions |

The answer is a `response` object: a `message` output item with one `output_text` part (unless
the model only called tools), then a `function_call` item per tool call; `status` `completed`, or
`incomplete` (`max_output_tokens`, `content_filter`) from the finish reason; `usage` in input and
output tokens. Streamed: `response.created`, `response.in_progress`, then for text
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` as the
model writes, `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`; for each tool call `response.output_item.added` when the model
names it, `response.function_call_arguments.delta` as it writes the arguments,
`response.function_call_arguments.done`, `response.output_item.done`; last `response.completed` (or `response.incomplete`) with the whole
response. A failure after the stream started ends it with `response.failed`. Errors are OpenAI's
shape, as on chat completions."""  # noqa: E501 (the mapping table's rows)

from typing import Any

from scheduler.gateway import shapes
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.calls import Dialect, GatewayError, StreamWriter, model_call, renamed, sse
from scheduler.gateway.feed import ToolPiece

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
NOT_KEPT = "Responses are not kept here (every call is stateless): send the whole conversation in 'input'."
# Fields accepted as they are: the defaults, or hints that change no answer.
IGNORED = ("stream_options", "prompt_cache_key", "prompt_cache_retention", "safety_identifier")
ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "user", "tool_choice", "parallel_tool_calls")
KNOWN = (
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "user",
    "stream",
    "text",
    "metadata",
    "store",
    "include",
    "truncation",
    "background",
    "service_tier",
    "reasoning",
    "previous_response_id",
    "conversation",
    *IGNORED,
)


def refused(field: str, why: str) -> GatewayError:
    return shapes.OpenAIError(400, f"'{field}' is not supported: {why}", code="unsupported_parameter", param=field)


# --- the request ---------------------------------------------------------------------------------


def translate(body: Any) -> shapes.ModelCall:
    """A Responses request as a chat completions job (the table in the module docstring)."""
    body = shapes._object(body)
    for name in body:
        if name not in KNOWN and body[name] is not None:
            raise refused(
                name, "this gateway serves the Responses API over chat completions, which has no such option."
            )
    _refuse_state(body)
    chat: dict[str, Any] = {"model": shapes._model(body)}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise shapes.bad_request("'instructions' must be a string.", "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + input_messages(
        body.get("input")
    )
    if body.get("tools") is not None:
        chat["tools"] = tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(body["tool_choice"])
    for name in ("parallel_tool_calls", "temperature", "top_p", "user", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        response_format = _text_format(text)
        if response_format is not None:
            chat["response_format"] = response_format
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values()) and len(metadata) <= 16
    ):
        raise shapes.bad_request("'metadata' must be an object of at most 16 string values.", "metadata")
    try:
        call = shapes.chat_call(chat)
    except shapes.OpenAIError as exc:
        raise renamed(exc, {"max_tokens": "max_output_tokens", "messages": "input"}) from None
    context = {name: body.get(name) for name in ECHOED}
    context.update(tools=body.get("tools") or [], metadata=metadata or {}, text=text or {"format": {"type": "text"}})
    return shapes.ModelCall(
        model=call.model, input=call.input, est_tokens=call.est_tokens, stream=call.stream, context=context
    )


def _refuse_state(body: dict[str, Any]) -> None:
    """What needs a kept response, or asks for what chat completions cannot give."""
    if body.get("previous_response_id") is not None:
        raise refused("previous_response_id", NOT_KEPT)
    if body.get("conversation") is not None:
        raise refused("conversation", NOT_KEPT)
    if body.get("store") is True:
        raise refused("store", "responses are not kept here; send 'store': false or leave it out.")
    if body.get("store") not in (None, False):
        raise shapes.bad_request("'store' must be a boolean.", "store")
    if body.get("include"):
        raise refused("include", "none of its extra outputs (logprobs, reasoning, tool results) exists here.")
    if body.get("truncation") not in (None, "disabled"):
        raise refused("truncation", "only 'disabled' is supported: the conversation is sent as it is.")
    if body.get("background") not in (None, False):
        raise refused("background", "calls are answered on the request that made them; nothing is kept to poll.")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise refused("service_tier", "the scheduler's queue and priorities decide how a call is served.")
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())):
        raise refused("reasoning", "chat completions carry no reasoning settings.")


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages."""
    if isinstance(value, str):
        if not value:
            raise shapes.bad_request("'input' must not be empty.", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise shapes.bad_request("'input' must be a string or a non-empty list of items.", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise shapes.bad_request(f"{where} must be an object.", where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where, "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and index and _joins(value[index - 1]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _output_text(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "item_reference":
            raise refused(f"{where}.type", NOT_KEPT)
        elif kind == "reasoning":
            raise refused(f"{where}.type", "reasoning items are OpenAI's models' own; chat completions carry none.")
        else:
            raise refused(f"{where}.type", f"{kind!r} items are not supported over chat completions.")
    return messages


def _joins(previous: Any) -> bool:
    """Whether a function call continues the assistant message the previous item made."""
    if not isinstance(previous, dict):
        return False
    kind = previous.get("type") or ("message" if "role" in previous else None)
    return kind == "function_call" or (kind == "message" and previous.get("role") == "assistant")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise shapes.bad_request(f"{where}.role must be one of {', '.join(ROLES)}.", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": ROLES[role], "content": content}
    if not isinstance(content, list):
        raise shapes.bad_request(f"{where}.content must be a string or a list of parts.", f"{where}.content")
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            parts.append({"type": "text", "text": _string(part, "text", at)})
        elif kind == "refusal" and role == "assistant":
            parts.append({"type": "text", "text": _string(part, "refusal", at)})
        elif kind == "input_image" and role != "assistant":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise refused(f"{at}.file_id", "images are taken by 'image_url' only: there is no file store here.")
            image = {"url": url, **({"detail": part["detail"]} if part.get("detail") else {})}
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise refused(f"{at}.type", f"{kind!r} parts are not supported over chat completions.")
    if all(part["type"] == "text" for part in parts):
        return {"role": ROLES[role], "content": "".join(part["text"] for part in parts)}
    return {"role": ROLES[role], "content": parts}


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for index, part in enumerate(output):
            if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS):
                raise refused(f"{where}[{index}]", "a tool's output reaches the model as text only.")
            texts.append(_string(part, "text", f"{where}[{index}]"))
        return "".join(texts)
    raise shapes.bad_request(f"{where} must be a string or a list of text parts.", where)


def _string(item: dict[str, Any], name: str, where: str, default: str | None = None) -> str:
    value = item.get(name, default)
    if not isinstance(value, str):
        raise shapes.bad_request(f"{where}.{name} must be a string.", f"{where}.{name}")
    return value


def tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise shapes.bad_request("'tools' must be a list.", "tools")
    chat = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise shapes.bad_request(f"{where} must be an object.", where)
        if tool.get("type") != "function":
            raise refused(
                f"{where}.type",
                f"only function tools are served over chat completions; {tool.get('type')!r} tools run at OpenAI.",
            )
        function = {"name": _string(tool, "name", where)}
        for name in ("description", "parameters", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        chat.append({"type": "function", "function": function})
    return chat


def tool_choice(value: Any) -> Any:
    if value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise refused("tool_choice", 'use none, auto, required or {"type": "function", "name": ...}.')


def _text_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        raise shapes.bad_request("'text' must be an object.", "text")
    if text.get("verbosity") is not None:
        raise refused("text.verbosity", "chat completions have no verbosity control.")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise shapes.bad_request("'text.format.type' must be text, json_object or json_schema.", "text.format.type")


# --- the answer ----------------------------------------------------------------------------------


def response_id(job_id: int) -> str:
    return f"resp_{job_id}"


def message_id(job_id: int) -> str:
    return f"msg_{job_id}"


def output_items(job_id: int, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's reply as output items: its text as a message (unless it only called tools),
    then one `function_call` per tool call."""
    message = result.get("message") or {}
    text, calls = str(message.get("content") or ""), message.get("tool_calls") or []
    status = "incomplete" if _incomplete(result) else "completed"
    items: list[dict[str, Any]] = []
    if text or not calls:
        items.append(_message_item(job_id, status, [_text_part(text)]))
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        items.append(
            {
                "type": "function_call",
                "id": _call_id(job_id, index),
                "call_id": call.get("id") or f"call_{job_id}_{index}",
                "name": function.get("name") or "",
                "arguments": function.get("arguments") or "",
                "status": "completed",
            }
        )
    return items


def _call_id(job_id: int, index: int) -> str:
    return f"fc_{job_id}_{index}"


def _call_index(item_id: str) -> int:
    return int(item_id.rsplit("_", 1)[1])


def _message_item(job_id: int, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": message_id(job_id), "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _incomplete(result: dict[str, Any]) -> str | None:
    return {"length": "max_output_tokens", "content_filter": "content_filter"}.get(result.get("finish_reason") or "")


def response_object(
    *,
    job_id: int,
    created: int,
    call: shapes.ModelCall,
    status: str,
    result: dict[str, Any] | None = None,
    error: GatewayError | None = None,
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `response` object, as the answer and as the stream's lifecycle events carry it."""
    context = call.context
    reason = _incomplete(result) if result is not None else None
    used = shapes.usage(result) if result is not None else None
    return {
        "id": response_id(job_id),
        "object": "response",
        "created_at": created,
        "status": "incomplete" if reason and status == "completed" else status,
        "background": False,
        "error": _error(error) if error else None,
        "incomplete_details": {"reason": reason} if reason else None,
        "instructions": context.get("instructions"),
        "max_output_tokens": context.get("max_output_tokens"),
        "metadata": context.get("metadata") or {},
        "model": (result or {}).get("model") or call.model,
        "output": output if output is not None else output_items(job_id, result) if result is not None else [],
        "parallel_tool_calls": context.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": False,
        "temperature": context.get("temperature"),
        "text": context.get("text") or {"format": {"type": "text"}},
        "tool_choice": context.get("tool_choice") or "auto",
        "tools": context.get("tools") or [],
        "top_p": context.get("top_p"),
        "truncation": "disabled",
        "usage": (
            {
                "input_tokens": used["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": used["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": used["total_tokens"],
            }
            if used
            else None
        ),
        "user": context.get("user"),
    }


def _error(error: GatewayError) -> dict[str, str]:
    """A failed response's error: OpenAI's few codes for it, and ours in the message."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {"code": code, "message": f"{error.message} ({error.code})" if error.code else error.message}


class ResponsesWriter(StreamWriter):
    """The Responses stream: lifecycle events around the output items' events, numbered. Items
    take their output index in the order they start: the message at its first text, a function
    call at its first piece."""

    def __init__(self, *, job_id: int, created: int, call: shapes.ModelCall) -> None:
        super().__init__()
        self.job_id, self.created, self.call = job_id, created, call
        self.sequence = 0
        self.started: list[str] = []  # item ids, by output index

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse(data, event=kind)

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return response_object(job_id=self.job_id, created=self.created, call=self.call, status=status, **extra)

    def opening(self, text: str) -> bytes:
        started = self._response("in_progress")
        return (
            self._event("response.created", response=started)
            + self._event("response.in_progress", response=started)
            + (self.text(text) if text else b"")
        )

    def _start(self, item: dict[str, Any]) -> bytes:
        """An output item's first events, at the next output index."""
        self.started.append(item["id"])
        index = len(self.started) - 1
        if item["type"] == "message":
            return self._event(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            ) + self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_text_part(""),
            )
        return self._event(
            "response.output_item.added",
            output_index=index,
            item={**item, "arguments": "", "status": "in_progress"},
        )

    def text(self, text: str) -> bytes:
        item_id = message_id(self.job_id)
        out = b"" if item_id in self.started else self._start(_message_item(self.job_id, "in_progress", []))
        return out + self._event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=self.started.index(item_id),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def tool_piece(self, piece: ToolPiece) -> bytes:
        item_id = _call_id(self.job_id, piece.index)
        out = b""
        if piece.first:
            item = {"type": "function_call", "id": item_id, "call_id": piece.id, "name": piece.name}
            out = self._start(item)
        if not piece.text:
            return out
        return out + self._event(
            "response.function_call_arguments.delta",
            item_id=item_id,
            output_index=self.started.index(item_id),
            delta=piece.text,
        )

    def closing(self, result: dict[str, Any], rest: str) -> bytes:
        rests = {index: left for index, _, left in self.tool_rests(result)}
        out = [self.text(rest)] if rest else []
        items = output_items(self.job_id, result)
        # The items as they were started, then those that were not, in the answer's order.
        order = {item_id: position for position, item_id in enumerate(self.started)}
        items.sort(key=lambda item: order.get(item["id"], len(order)))
        for index, item in enumerate(items):
            if item["id"] not in order:
                out.append(self._start(item))
            if item["type"] == "message":
                ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                part = item["content"][0]
                out += [
                    self._event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", **ids, part=part),
                ]
            else:
                ids = {"item_id": item["id"], "output_index": index}
                left = rests.get(_call_index(item["id"]))
                left = item["arguments"] if left is None else left
                if left:
                    out.append(self._event("response.function_call_arguments.delta", **ids, delta=left))
                out.append(
                    self._event(
                        "response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"]
                    )
                )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        final = self._response("completed", result=result, output=items)
        out.append(self._event(f"response.{final['status']}", response=final))
        return b"".join(out)

    def failure(self, error: GatewayError) -> bytes:
        return self._event("response.failed", response=self._response("failed", error=error))


class ResponsesDialect(Dialect):
    via = "responses"

    def translate(self, body: Any) -> shapes.ModelCall:
        return translate(body)

    def answer(self, *, job_id: int, created: int, call: shapes.ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return response_object(job_id=job_id, created=created, call=call, status="completed", result=result)

    def writer(self, *, job_id: int, created: int, call: shapes.ModelCall) -> StreamWriter:
        return ResponsesWriter(job_id=job_id, created=created, call=call)

    def late_error(self, error: GatewayError) -> bytes:
        data = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return sse({**data, "sequence_number": 0}, event="error")


RESPONSES = ResponsesDialect()


async def create(request: Request, reply: Reply) -> None:
    """POST /v1/responses."""
    await model_call(request, reply, dialect=RESPONSES)
