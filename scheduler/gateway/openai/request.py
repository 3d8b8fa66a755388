"""What an OpenAI chat completions or embeddings request may say, checked before it is queued (so a
bad body costs no queue time), and the chat job it becomes. The Responses and Messages dialects
check the chat completion they translate to here too."""

import math
from typing import Any

from executors.contract import EMBEDDINGS_API
from executors.drivers.openai import EMBEDDING_OPTIONS, PASSTHROUGH_OPTIONS
from executors.tokens import count_prompt_tokens, embedding_inputs
from scheduler.core.estimates import completion_estimate
from scheduler.gateway.dialect import ModelCall, body_object, model_name
from scheduler.gateway.errors import bad_request
from telemachus.http.bounds import DIMENSIONS_MAX, MAX_TOKENS

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Bounds that keep a request's numbers storable and its budget estimate meaningful (the REST API's).
MAX_TOKENS_LIMIT, MAX_DIMENSIONS = MAX_TOKENS, DIMENSIONS_MAX


def chat_call(body: Any) -> ModelCall:
    """Check a chat completions body. Options OpenAI-compatible servers share pass through to the
    model server (executors/drivers/openai.py names them); others are dropped; `n` must be 1."""
    body = body_object(body)
    model = model_name(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages.", "messages")
    for index, message in enumerate(messages):
        _check_message(message, index)
    stream = _optional(body, "stream", bool, False)
    stream_options = _optional(body, "stream_options", dict, None) or {}
    if stream_options and not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true.", "stream_options")
    if body.get("n") not in (None, 1):
        raise bad_request("Only n=1 is supported.", "n")
    options: dict[str, Any] = {}
    for name in ("max_tokens", "max_completion_tokens", "top_logprobs", "seed"):
        value = _optional(body, name, int, None)
        if value is not None:
            if name in ("max_tokens", "max_completion_tokens") and not 1 <= value <= MAX_TOKENS_LIMIT:
                raise bad_request(f"'{name}' must be from 1 to {MAX_TOKENS_LIMIT}.", name)
            if name in ("top_logprobs", "seed") and abs(value) > 2**63 - 1:
                raise bad_request(f"'{name}' is out of range.", name)
            options[name] = value
    # Local model servers know max_tokens; the newer name means the same for them.
    if "max_completion_tokens" in options:
        options.setdefault("max_tokens", options.pop("max_completion_tokens"))
    for name, low, high in (
        ("temperature", 0, 2),
        ("top_p", 0, 1),
        ("presence_penalty", -2, 2),
        ("frequency_penalty", -2, 2),
    ):
        value = _optional(body, name, float, None)
        if value is not None:
            if not low <= value <= high:
                raise bad_request(f"'{name}' must be between {low} and {high}.", name)
            options[name] = value
    if "tools" in body and body["tools"] is not None:
        _check_tools(body["tools"])
    if "tool_choice" in body and body["tool_choice"] is not None:
        _check_tool_choice(body["tool_choice"])
    for name in (
        "stop",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "logprobs",
        "logit_bias",
        "user",
    ):
        if body.get(name) is not None:
            options[name] = body[name]
    options = {k: v for k, v in options.items() if k in PASSTHROUGH_OPTIONS}
    estimate = count_prompt_tokens(messages) + completion_estimate(model=model, max_tokens=options.get("max_tokens"))
    job_input = {"messages": messages, **options, **({"stream": True} if stream else {})}
    return ModelCall(
        model=model,
        input=job_input,
        est_tokens=estimate,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage")),
    )


def embeddings_call(body: Any) -> ModelCall:
    body = body_object(body)
    model = model_name(body)
    if not _embeddable(body.get("input")):
        raise bad_request("'input' must be a non-empty string, or a non-empty list of them (or of token ids).", "input")
    texts = embedding_inputs(body["input"])
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'.", "encoding_format")
    dimensions = _optional(body, "dimensions", int, None)
    if dimensions is not None and not 1 <= dimensions <= MAX_DIMENSIONS:
        raise bad_request(f"'dimensions' must be from 1 to {MAX_DIMENSIONS}.", "dimensions")
    options = {k: body[k] for k in EMBEDDING_OPTIONS if body.get(k) is not None}
    return ModelCall(
        model=model,
        input={"input": body["input"], **options},
        est_tokens=sum(len(text.split()) for text in texts),
        api=EMBEDDINGS_API,
    )


def _embeddable(value: Any) -> bool:
    """OpenAI's embeddings input: a string, a list of strings, a list of token ids (ints), or a
    list of such lists; nothing empty."""

    def tokens(item: Any) -> bool:
        return isinstance(item, list) and bool(item) and all(type(t) is int for t in item)

    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    return tokens(value) or all((isinstance(item, str) and item) or tokens(item) for item in value)


def _optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind not in (int, float) and isinstance(value, kind):
        return value
    names = {bool: "a boolean", int: "an integer", float: "a number", dict: "an object"}
    raise bad_request(f"'{name}' must be {names[kind]}.", name)


def _check_message(message: Any, index: int) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object.", where)
    if message.get("role") not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}.", f"{where}.role")
    content = message.get("content")
    if content is None:
        if message["role"] != "assistant":
            raise bad_request(f"{where}.content is required.", f"{where}.content")
    elif not isinstance(content, str | list):
        raise bad_request(f"{where}.content must be a string or a list of content parts.", f"{where}.content")
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise bad_request(f"{where}.tool_call_id is required for a tool message.", f"{where}.tool_call_id")


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", "tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(
                f'tools[{index}] must be {{"type": "function", "function": {{"name": ...}}}}.', f"tools[{index}]"
            )


def _check_tool_choice(choice: Any) -> None:
    if choice in ("none", "auto", "required"):
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return
    raise bad_request(
        '\'tool_choice\' must be none, auto, required or {"type": "function", "function": {"name": ...}}.',
        "tool_choice",
    )
