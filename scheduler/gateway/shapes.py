"""OpenAI's shapes: what a chat completions or embeddings request may say (checked before it is
queued, so a bad body costs no queue time), the response and chunk bodies, and the error shape
`{"error": {"message", "type", "param", "code"}}` with its status codes."""

import math
import time
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from executors.contract import EMBEDDINGS_API
from executors.drivers.openai import EMBEDDING_OPTIONS, PASSTHROUGH_OPTIONS
from executors.tokens import count_prompt_tokens, embedding_inputs
from scheduler.core.estimates import completion_estimate
from scheduler.models import Job
from telemachus import errors
from telemachus.http.bounds import DIMENSIONS_MAX, MAX_TOKENS
from telemachus.http.parsers import MAX_DEPTH, json_parse, json_problem

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Bounds that keep a request's numbers storable and its budget estimate meaningful (the REST API's).
MAX_TOKENS_LIMIT, MAX_DIMENSIONS = MAX_TOKENS, DIMENSIONS_MAX
MAX_MODEL_LENGTH = 200


class OpenAIError(Exception):
    """An error answered in OpenAI's shape. `retry` False adds `x-should-retry: false`, which
    OpenAI's SDKs obey instead of retrying on their own (they retry 409, 429 and 5xx by default)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = dict(headers or {})
        if retry is False:
            self.headers["x-should-retry"] = "false"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, code="invalid_request", param=param)


def not_authenticated() -> OpenAIError:
    return OpenAIError(
        401,
        "Missing or invalid API key: send Authorization: Bearer <your Telemachus API token>.",
        code="invalid_api_key",
    )


def from_domain(exc: errors.DomainError) -> OpenAIError:
    """The API's domain errors (submit's checks) in OpenAI's shape."""
    if isinstance(exc, errors.UnknownModel):
        return OpenAIError(404, exc.detail, code="model_not_found", param="model")
    if isinstance(exc, errors.TryLater):
        return OpenAIError(
            429, exc.detail, type="rate_limit_error", code="try_later", headers={"retry-after": str(exc.retry_after)}
        )
    if isinstance(exc, errors.QuotaExceeded):
        wait = _seconds_until(exc.extra.get("reset_at"))
        # Past a minute the SDKs ignore Retry-After and retry within seconds: pointless for a budget.
        return OpenAIError(
            429,
            exc.detail,
            type="insufficient_quota",
            code="quota_exceeded",
            headers={"retry-after": str(wait)},
            retry=wait <= 60,
        )
    if isinstance(exc, errors.ValidationFailed):
        fields = exc.extra.get("fields") or {}
        param = next(iter(fields), None)
        detail = "; ".join(f"{name}: {' '.join(map(str, _flat(msgs)))}" for name, msgs in fields.items())
        return bad_request(detail or exc.detail, param)
    if isinstance(exc, errors.Forbidden):
        return OpenAIError(403, exc.detail, type="permission_error", code="forbidden", retry=False)
    if isinstance(exc, errors.NotFound):
        return OpenAIError(404, exc.detail, code="not_found", retry=False)
    return OpenAIError(exc.status, exc.detail, code=exc.code, retry=False)


def _seconds_until(stamp: Any) -> int:
    when = parse_datetime(str(stamp)) if stamp else None
    if when is None:
        return 60
    return max(1, math.ceil((when - timezone.now()).total_seconds()))


def _flat(messages: Any) -> list[Any]:
    if isinstance(messages, dict):
        return [f"{k}: {' '.join(map(str, _flat(v)))}" for k, v in messages.items()]
    return list(messages) if isinstance(messages, list | tuple) else [messages]


# --- requests ------------------------------------------------------------------------------------


def parse_body(raw: bytes) -> Any:
    """The body as JSON that the database can store, refused as the REST API's parser refuses it
    (telemachus/http/parsers.py), naming the JSON path (`logit_bias.50256`) in `param`: no number
    that is not finite (NaN, Infinity, or `1e999`, which Python's json reads as infinity), nothing
    nested deeper than MAX_DEPTH, no NUL character or unpaired surrogate in any key or string."""
    try:
        data = json_parse(raw)
    except RecursionError:
        raise bad_request(f"The body is nested deeper than {MAX_DEPTH} levels.") from None
    except ValueError:
        raise bad_request("The body is not valid JSON.") from None
    problem = json_problem(data)
    if problem is not None:
        path, message = problem
        raise bad_request(f"{path}: {message}" if path else message, path or None)
    return data


@dataclass(frozen=True)
class ModelCall:
    """A checked request, as the chat job it becomes."""

    model: str
    input: dict[str, Any]
    est_tokens: int
    stream: bool = False
    include_usage: bool = False
    api: str = "chat"
    requirements: dict[str, Any] = field(default_factory=dict)
    # What a translated protocol (Responses, Messages) echoes back or needs to shape its answer.
    context: dict[str, Any] = field(default_factory=dict)


def chat_call(body: Any) -> ModelCall:
    """Check a chat completions body. Options OpenAI-compatible servers share pass through to the
    model server (executors/drivers/openai.py names them); others are dropped; `n` must be 1."""
    body = _object(body)
    model = _model(body)
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
    body = _object(body)
    model = _model(body)
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


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > MAX_MODEL_LENGTH:
        raise bad_request(f"'model' must be a model name (a string of 1 to {MAX_MODEL_LENGTH} characters).", "model")
    return model


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


# --- responses -----------------------------------------------------------------------------------


def completion_id(job_id: int) -> str:
    return f"chatcmpl-{job_id}"


def usage(result: dict[str, Any] | None) -> dict[str, int]:
    reported = (result or {}).get("usage") or {}
    prompt, completion = int(reported.get("prompt_tokens") or 0), int(reported.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(*, job_id: int, created: int, model: str, result: dict[str, Any]) -> dict[str, Any]:
    message = dict(result.get("message") or {"role": "assistant", "content": ""})
    message.setdefault("role", "assistant")
    return {
        "id": completion_id(job_id),
        "object": "chat.completion",
        "created": created,
        "model": result.get("model") or model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": result.get("finish_reason") or "stop", "logprobs": None}
        ],
        "usage": usage(result),
    }


def chunk(
    *,
    job_id: int,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    choices: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "id": completion_id(job_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}] if choices else [],
        **extra,
    }


def embeddings(*, model: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": result.get("data") or [],
        "model": result.get("model") or model,
        "usage": {"prompt_tokens": usage(result)["prompt_tokens"], "total_tokens": usage(result)["prompt_tokens"]},
    }


def model_list(models: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(m) for m in models]}


def model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "telemachus"}


def failure(*, status: str, error: str, upstream_status: int | None, timed_out: bool) -> OpenAIError:
    """A job that ended without an answer: failed after its retries (502, or 504 when the model
    server did not answer in time; the model server's own 4xx passes through), or canceled. The
    scheduler has retried already, so the SDK is told not to."""
    if status == Job.Status.CANCELED:
        return OpenAIError(409, "The job was canceled before it finished.", code="job_canceled", retry=False)
    if timed_out or upstream_status in (408, 504):
        return OpenAIError(
            504,
            error or "The model server did not answer in time.",
            type="api_error",
            code="executor_timeout",
            retry=False,
        )
    if upstream_status and 400 <= upstream_status < 500 and upstream_status != 429:
        return OpenAIError(upstream_status, error, code="model_server_rejected", retry=False)
    return OpenAIError(502, error or "The model server failed.", type="api_error", code="executor_error", retry=False)


def now() -> int:
    return int(time.time())
