"""A protocol the gateway speaks (OpenAI's chat completions, the Responses API, Anthropic's
Messages: openai/, responses/, anthropic/) is a `Dialect`: it says how a body becomes the chat job
it runs as (`ModelCall`, refusing what it cannot carry), how the job's result is answered, plain
or as a stream (a `StreamWriter`), and how an error looks. What they share is here: the body parsed
and checked as JSON the database can store (`parse_body`), its object and its model
(`body_object`, `model_name`), errors answered in the dialect's shape (`respond_error`,
`answering_errors`), Server-Sent Events (`sse`). Queueing, waiting and relaying are calls.py's."""

import json
from dataclasses import dataclass, field
from typing import Any

from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.errors import INTERRUPTED, GatewayError, bad_request, from_domain
from scheduler.gateway.relay import ToolPiece
from telemachus import errors
from telemachus.http.parsers import MAX_DEPTH, json_parse, json_problem

MAX_MODEL_LENGTH = 200
JOB_HEADER = "x-telemachus-job"
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}


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


def body_object(body: Any) -> dict[str, Any]:
    """The body, if it is a JSON object (a 400 otherwise)."""
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    return body


def model_name(body: dict[str, Any]) -> str:
    """The body's `model`: a name of 1 to MAX_MODEL_LENGTH characters (a 400 otherwise)."""
    model = body.get("model")
    if not isinstance(model, str) or not model.strip() or len(model) > MAX_MODEL_LENGTH:
        raise bad_request(f"'model' must be a model name (a string of 1 to {MAX_MODEL_LENGTH} characters).", "model")
    return model


class StreamWriter:
    """The SSE bytes of one streamed call, in a protocol's events. Called in order: `opening` once
    (with the first text, maybe empty), `text` and `tool` for each later piece of the reply's text
    or of a tool call's arguments, then `closing` (with the job's result and the text not yet
    relayed; `tool_rests()` says what of the tool calls is) or `failure`."""

    keepalive = b": keepalive\n\n"

    def __init__(self) -> None:
        self.relayed: dict[int, ToolPiece] = {}  # tool calls relayed: index -> id, name, arguments sent

    def tool(self, piece: ToolPiece) -> bytes:
        """A piece of a tool call's arguments (the first with its id and name), as far as the
        protocol can send it now."""
        out = self.tool_piece(piece)
        if out is None:
            return b""
        sent = self.relayed.get(piece.index)
        self.relayed[piece.index] = ToolPiece(
            piece.index, piece.id, piece.name, (sent.text if sent else "") + piece.text, first=True
        )
        return out

    def tool_piece(self, piece: ToolPiece) -> bytes | None:
        """The piece's events; None if it cannot be sent in order now (`closing` then finds it
        unsent)."""
        raise NotImplementedError

    def tool_rests(self, result: dict[str, Any]) -> list[tuple[int, dict[str, Any], str | None]]:
        """Each tool call of the result with what is left to relay of it: None when none of it was
        relayed, else the rest of its arguments. A result that does not continue what was relayed
        cannot be streamed any more (INTERRUPTED)."""
        calls = (result.get("message") or {}).get("tool_calls") or []
        if any(index >= len(calls) for index in self.relayed):
            raise INTERRUPTED
        rests: list[tuple[int, dict[str, Any], str | None]] = []
        for index, call in enumerate(calls):
            function = call.get("function") or {}
            sent = self.relayed.get(index)
            if sent is None:
                rests.append((index, call, None))
                continue
            arguments = str(function.get("arguments") or "")
            if (call.get("id") or "", function.get("name") or "") != (sent.id, sent.name) or not arguments.startswith(
                sent.text
            ):
                raise INTERRUPTED
            rests.append((index, call, arguments[len(sent.text) :]))
        return rests

    def opening(self, text: str) -> bytes:
        raise NotImplementedError

    def text(self, text: str) -> bytes:
        raise NotImplementedError

    def closing(self, result: dict[str, Any], rest: str) -> bytes:
        raise NotImplementedError

    def failure(self, error: GatewayError) -> bytes:
        raise NotImplementedError


class Dialect:
    """A model API the gateway speaks. `via` is recorded in the job's meta; `api_key_header` names a
    header that may carry the token instead of `Authorization` (Anthropic's `x-api-key`)."""

    via = "openai"
    api_key_header: str | None = None

    def translate(self, body: Any) -> ModelCall:
        """The body as the chat job it becomes; raises GatewayError (400, naming the field) for what
        it cannot carry."""
        raise NotImplementedError

    def answer(self, *, job_id: int, created: int, call: ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def writer(self, *, job_id: int, created: int, call: ModelCall) -> StreamWriter:
        raise NotImplementedError

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        return error.body()

    def late_error(self, error: GatewayError) -> bytes:
        """The last event of a stream that fails after it started, outside a StreamWriter's care."""
        return sse(self.error_body(error))

    def authorization(self, request: Request) -> str | None:
        """The credentials as an Authorization header value."""
        header = request.header("authorization")
        if header is None and self.api_key_header:
            key = request.header(self.api_key_header)
            return f"Bearer {key.strip()}" if key and key.strip() else None
        return header


def renamed(exc: GatewayError, names: dict[str, str]) -> GatewayError:
    """A chat completions check's error, naming the field as this protocol calls it."""
    name = names.get(exc.param or "")
    if name is None:
        return exc
    message = exc.message.replace(f"'{exc.param}'", f"'{name}'")
    return GatewayError(exc.status, message, type=exc.type, code=exc.code, param=name, headers=exc.headers)


async def answering_errors(reply: Reply, dialect: Dialect, handler: Any) -> None:
    """Await `handler` (a coroutine), rendering the errors it raises in the dialect's shape."""
    try:
        await handler
    except (GatewayError, errors.DomainError) as exc:
        failure = exc if isinstance(exc, GatewayError) else from_domain(exc)
        if not reply.started:
            await respond_error(reply, dialect, failure)
        elif not reply.finished:  # a stream under way: the error is its last event
            await reply.end(dialect.late_error(failure))


async def respond_error(reply: Reply, dialect: Dialect, error: GatewayError, job_id: int | None = None) -> None:
    headers = {**error.headers, **({JOB_HEADER: str(job_id)} if job_id else {})}
    await reply.json(error.status, dialect.error_body(error), headers)


def sse(data: Any, event: str | None = None) -> bytes:
    """One Server-Sent Event (with an `event:` line when the protocol names its events)."""
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"
