"""A Responses request as the chat completions job it becomes, or a 400 naming the field it cannot
carry (the table in scheduler/gateway/responses/__init__.py)."""

from typing import Any

from scheduler.gateway.dialect import ModelCall, body_object, model_name, renamed
from scheduler.gateway.errors import GatewayError, bad_request
from scheduler.gateway.openai.request import chat_call

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
    return GatewayError(400, f"'{field}' is not supported: {why}", code="unsupported_parameter", param=field)


def translate(body: Any) -> ModelCall:
    """A Responses request as a chat completions job (the table in the module docstring)."""
    body = body_object(body)
    for name in body:
        if name not in KNOWN and body[name] is not None:
            raise refused(
                name, "this gateway serves the Responses API over chat completions, which has no such option."
            )
    _refuse_state(body)
    chat: dict[str, Any] = {"model": model_name(body)}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string.", "instructions")
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
        raise bad_request("'metadata' must be an object of at most 16 string values.", "metadata")
    try:
        call = chat_call(chat)
    except GatewayError as exc:
        raise renamed(exc, {"max_tokens": "max_output_tokens", "messages": "input"}) from None
    context = {name: body.get(name) for name in ECHOED}
    context.update(tools=body.get("tools") or [], metadata=metadata or {}, text=text or {"format": {"type": "text"}})
    return ModelCall(
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
        raise bad_request("'store' must be a boolean.", "store")
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
            raise bad_request("'input' must not be empty.", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items.", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object.", where)
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
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}.", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts.", f"{where}.content")
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
    raise bad_request(f"{where} must be a string or a list of text parts.", where)


def _string(item: dict[str, Any], name: str, where: str, default: str | None = None) -> str:
    value = item.get(name, default)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string.", f"{where}.{name}")
    return value


def tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list.", "tools")
    chat = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where} must be an object.", where)
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
        raise bad_request("'text' must be an object.", "text")
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
    raise bad_request("'text.format.type' must be text, json_object or json_schema.", "text.format.type")
