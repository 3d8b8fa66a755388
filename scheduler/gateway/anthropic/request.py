"""A Messages request as the chat completions job it becomes, or a 400 naming the field it cannot
carry (the table in scheduler/gateway/anthropic/__init__.py)."""

import json
from typing import Any

from executors.tokens import count_prompt_tokens
from scheduler.gateway.dialect import ModelCall, body_object, model_name, renamed
from scheduler.gateway.errors import GatewayError, bad_request
from scheduler.gateway.openai.request import chat_call

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


def refused(field: str, why: str) -> GatewayError:
    return GatewayError(400, f"{field}: not supported: {why}", code="unsupported_parameter", param=field)


def translate(body: Any, *, counting: bool = False) -> ModelCall:
    """A Messages request as a chat completions job (the table in the module docstring). For
    `count_tokens` (`counting`), `max_tokens` is not asked for."""
    body = body_object(body)
    for name in body:
        if name not in KNOWN and body[name] is not None:
            raise refused(name, "this gateway serves the Messages API over chat completions, which has no such option.")
    chat: dict[str, Any] = {"model": model_name(body)}
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not counting:
        raise bad_request("max_tokens: Field required", "max_tokens")
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    chat["messages"] = _system(body.get("system")) + messages(body.get("messages"))
    for name in ("temperature", "top_p", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise bad_request("stop_sequences: must be a list of non-empty strings", "stop_sequences")
        if stops:
            chat["stop"] = stops
    if body.get("tools") is not None:
        chat["tools"] = tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat.update(tool_choice(body["tool_choice"]))
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise bad_request("metadata: only user_id is accepted", "metadata")
        if metadata.get("user_id") is not None:
            chat["user"] = str(metadata["user_id"])
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise refused("thinking", "extended thinking has no counterpart in chat completions.")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise bad_request("service_tier: must be auto or standard_only", "service_tier")
    response_format = _output_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        call = chat_call(chat)
    except GatewayError as exc:
        raise renamed(exc, {"stop": "stop_sequences"}) from None
    prompt = count_prompt_tokens(chat["messages"])
    return ModelCall(
        model=call.model, input=call.input, est_tokens=call.est_tokens, stream=call.stream, context={"prompt": prompt}
    )


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))}]
    raise bad_request("system: must be a string or a list of text blocks", "system")


def _text_block(block: Any, where: str) -> str:
    if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
        raise refused(f"{where}.type", "only text blocks are taken here.")
    return str(block["text"])


def messages(value: Any) -> list[dict[str, Any]]:
    """Anthropic's messages as chat messages."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages: must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where}: must be an object", where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be user or assistant", f"{where}.role")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif isinstance(content, list):
            chat += _user(content, where) if role == "user" else [_assistant(content, where)]
        else:
            raise bad_request(f"{where}.content: must be a string or a list of blocks", f"{where}.content")
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
                raise bad_request(f"{at}.tool_use_id: must be a string", f"{at}.tool_use_id")
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
                raise bad_request(f"{at}: a tool_use block needs an id and a name", at)
            if not isinstance(block.get("input"), dict):
                raise bad_request(f"{at}.input: must be an object", f"{at}.input")
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
        return str(source["url"])
    raise refused(f"{where}.source", "images are taken as base64 or url sources only: there is no file store here.")


def _result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_block(block, f"{where}[{i}]") for i, block in enumerate(content))
    raise bad_request(f"{where}: must be a string or a list of text blocks", where)


def tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad_request("tools: must be a list", "tools")
    chat = []
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{where}: must be an object", where)
        if tool.get("type") not in (None, "custom"):
            raise refused(f"{where}.type", f"{tool.get('type')!r} tools run at Anthropic; only custom tools run here.")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"{where}.name: Field required", f"{where}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"{where}.input_schema: Field required", f"{where}.input_schema")
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
        raise bad_request("tool_choice: must be auto, any, tool (with a name) or none", "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        options["parallel_tool_calls"] = False
    return options


def _output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config: must be an object", "output_config")
    if config and config.get("effort") is not None:
        raise refused("output_config.effort", "chat completions carry no effort setting.")
    fmt = body.get("output_format") or (config or {}).get("format")
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
        raise bad_request("output_config.format: must be {type: json_schema, schema: {...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
