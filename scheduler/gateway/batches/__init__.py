"""The Batch API's doors: OpenAI's Files and Batches APIs (`/v1/files`, `/v1/batches`) and
Anthropic's Message Batches API (`/v1/messages/batches`), on the durable queue (docs/batches.md).

The caller and the team are found as for a live call (caller.py: the key or token, the
`X-Telemachus-Team` header or the caller's only team, the `openai` feature switch, the rate);
files and batches belong to the team, and other teams' read as not found. Each line of a batch
becomes a chat job of the team through the one submit path, fed by the workers
(scheduler/batches/feeder.py); here a batch is created (its input checked: lines.py), read,
listed and cancelled, and its files are uploaded (upload.py) and read."""

from collections.abc import Callable
from typing import Any

from django.utils import timezone

from scheduler.batches.files import file_chunk, file_delete, file_for, file_lines, files_of
from scheduler.batches.models import Batch
from scheduler.batches.services import (
    WINDOWS,
    CheckedLine,
    InvalidInput,
    batch_cancel,
    batch_counts,
    batch_create,
    batch_for,
    batches_of,
)
from scheduler.connections import db
from scheduler.gateway.anthropic import MESSAGES
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.auth import client_address
from scheduler.gateway.batches.lines import checked_line, openai_lines
from scheduler.gateway.batches.shapes import (
    ANTHROPIC_ENDPOINT,
    OPENAI_ENDPOINTS,
    batch_object,
    file_object,
    message_batch_object,
    page,
)
from scheduler.gateway.caller import TEAM_HEADER, Caller, caller_for
from scheduler.gateway.dialect import Dialect, answering_errors, parse_body, respond_error
from scheduler.gateway.errors import GatewayError, bad_request, method_not_allowed, unknown_url
from scheduler.gateway.openai import CHAT
from telemachus import tracing

__all__ = ["serve_anthropic", "serve_openai"]

MAX_METADATA_PAIRS, MAX_METADATA_VALUE = 16, 512
ANTHROPIC_MAX_REQUESTS = 100_000
CUSTOM_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _caller(request: Request, dialect: Dialect) -> Any:
    return db(
        caller_for,
        authorization=dialect.authorization(request),
        team=request.header(TEAM_HEADER),
        confirm=True,
        address=client_address(request.scope),
    )


def _limit(request: Request, name: str = "limit", *, default: int, most: int) -> int:
    raw = request.param(name)
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"'{name}' must be an integer from 1 to {most}.", name)
    return int(raw)


# --- OpenAI: /v1/files, /v1/batches ---------------------------------------------------------------


async def serve_openai(request: Request, reply: Reply, rest: str) -> None:
    """Route /v1/files... (but the upload, upload.py) and /v1/batches...; errors in OpenAI's shape."""
    parts = rest.strip("/").split("/")
    routes: dict[tuple[str, int], dict[str, Any]] = {
        ("files", 1): {"GET": files_list},
        ("files", 2): {"GET": file_retrieve, "DELETE": file_remove},
        ("files", 3): {"GET": file_content} if parts[-1] == "content" else {},
        ("batches", 1): {"POST": batch_new, "GET": batches_list},
        ("batches", 2): {"GET": batch_retrieve},
        ("batches", 3): {"POST": batch_stop} if parts[-1] == "cancel" else {},
    }
    methods = routes.get((parts[0], len(parts)))
    if not methods:
        return await respond_error(reply, CHAT, unknown_url(request))
    handler = methods.get(request.method)
    if handler is None:
        return await respond_error(reply, CHAT, method_not_allowed(request, ", ".join(methods)))
    await answering_errors(reply, CHAT, handler(request, reply, *parts[1:2]))


async def files_list(request: Request, reply: Reply) -> None:
    caller = await _caller(request, CHAT)
    limit = _limit(request, default=10000, most=10000)
    found = await db(
        files_of, team=caller.team, purpose=request.param("purpose"), after=request.param("after"), limit=limit + 1
    )
    await reply.json(200, page([file_object(f) for f in found[:limit]], has_more=len(found) > limit))


async def file_retrieve(request: Request, reply: Reply, file_id: str) -> None:
    caller = await _caller(request, CHAT)
    await reply.json(200, file_object(await db(file_for, team=caller.team, file_id=file_id)))


async def file_remove(request: Request, reply: Reply, file_id: str) -> None:
    caller = await _caller(request, CHAT)
    await db(file_delete, team=caller.team, file_id=file_id)
    await reply.json(200, {"id": file_id, "object": "file", "deleted": True})


async def file_content(request: Request, reply: Reply, file_id: str) -> None:
    caller = await _caller(request, CHAT)
    found = await db(file_for, team=caller.team, file_id=file_id)
    await _stream_file(reply, found.pk, size=found.bytes)


async def _stream_file(reply: Reply, file_id: str, *, size: int) -> None:
    """The file's bytes, a chunk at a time (one read each): never whole in memory."""
    await reply.start(200, {"content-type": "application/octet-stream", "content-length": str(size)})
    seq = 0
    while (data := await db(file_chunk, file_id=file_id, seq=seq)) is not None:
        await reply.write(data)
        seq += 1
    await reply.end()


async def batch_new(request: Request, reply: Reply) -> None:
    body = parse_body(request.body)
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    endpoint = body.get("endpoint")
    if endpoint not in OPENAI_ENDPOINTS:
        raise bad_request(f"'endpoint' must be one of {', '.join(OPENAI_ENDPOINTS)}.", "endpoint")
    window = body.get("completion_window")
    if window not in WINDOWS:
        raise bad_request(f"'completion_window' must be one of {', '.join(WINDOWS)}.", "completion_window")
    input_file_id = body.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise bad_request("'input_file_id' must be the id of an uploaded file of purpose 'batch'.", "input_file_id")
    metadata = _metadata(body.get("metadata"))
    caller = await _caller(request, CHAT)
    batch = await _created(
        request,
        _openai_create,
        caller=caller,
        input_file_id=input_file_id,
        endpoint=endpoint,
        window=window,
        metadata=metadata,
    )
    await reply.json(200, batch_object(batch, await db(batch_counts, batch=batch)))


async def _created(request: Request, create: Callable[..., Batch], *, caller: Caller, **arguments: Any) -> Batch:
    """The batch `create` stores, on a database thread; while tracing, inside a span (kind SERVER)
    that continues the caller's `traceparent` and that each of its lines' spans links to
    (scheduler/batches/feeder.py, docs/tracing.md)."""
    if not tracing.active:
        return await db(create, caller=caller, trace=None, **arguments)
    with tracing.span(
        f"{request.method} {request.path}",
        parent=tracing.context_from_headers(request.headers),
        server=True,
        attributes={
            "http.request.method": request.method,
            "url.path": request.path,
            "telemachus.team": caller.team.slug,
        },
    ) as span:
        batch = await db(create, caller=caller, trace=tracing.trace_carrier(), **arguments)
        span.set_attributes({"telemachus.batch.id": batch.pk, "telemachus.batch.lines": batch.lines})
        return batch


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and len(k) <= 64 for k in value)
        or not all(isinstance(v, str) and len(v) <= MAX_METADATA_VALUE for v in value.values())
    ):
        raise bad_request(
            f"'metadata' must map at most {MAX_METADATA_PAIRS} keys of up to 64 characters to strings of up "
            f"to {MAX_METADATA_VALUE}.",
            "metadata",
        )
    return value


def _openai_create(
    *,
    caller: Caller,
    input_file_id: str,
    endpoint: str,
    window: str,
    metadata: dict[str, str] | None,
    trace: dict[str, str] | None,
) -> Batch:
    """Check the input file a chunk at a time and store the batch with its lines."""
    source = file_for(team=caller.team, file_id=input_file_id)
    if source.purpose != "batch":
        raise bad_request("The input file's purpose must be 'batch'.", "input_file_id")
    return batch_create(
        id_prefix="batch_",
        api=Batch.Api.OPENAI,
        team=caller.team,
        user=caller.user,
        key=caller.key,
        endpoint=endpoint,
        input_file_id=source.pk,
        window=WINDOWS[window],
        completion_window=window,
        metadata=metadata,
        lines=openai_lines(file_lines(file_id=source.pk), endpoint=endpoint, dialect=OPENAI_ENDPOINTS[endpoint]),
        now=timezone.now(),
        trace=trace,
    )


async def batches_list(request: Request, reply: Reply) -> None:
    caller = await _caller(request, CHAT)
    limit = _limit(request, default=20, most=100)
    found = await db(batches_of, team=caller.team, api=Batch.Api.OPENAI, after=request.param("after"), limit=limit + 1)
    data = [batch_object(b, await db(batch_counts, batch=b)) for b in found[:limit]]
    await reply.json(200, page(data, has_more=len(found) > limit))


async def batch_retrieve(request: Request, reply: Reply, batch_id: str) -> None:
    caller = await _caller(request, CHAT)
    batch = await db(batch_for, team=caller.team, batch_id=batch_id, api=Batch.Api.OPENAI)
    await reply.json(200, batch_object(batch, await db(batch_counts, batch=batch)))


async def batch_stop(request: Request, reply: Reply, batch_id: str) -> None:
    caller = await _caller(request, CHAT)
    batch = await db(
        batch_cancel, team=caller.team, batch_id=batch_id, api=Batch.Api.OPENAI, by=caller.user, now=timezone.now()
    )
    await reply.json(200, batch_object(batch, await db(batch_counts, batch=batch)))


# --- Anthropic: /v1/messages/batches --------------------------------------------------------------


async def serve_anthropic(request: Request, reply: Reply, rest: str | None = None) -> None:
    """Route /v1/messages/batches...; errors in Anthropic's shape."""
    parts = [p for p in (rest or "").strip("/").split("/") if p]
    routes: dict[int, dict[str, Any]] = {
        0: {"POST": message_batch_new, "GET": message_batches_list},
        1: {"GET": message_batch_retrieve},
        2: {"POST": message_batch_stop}
        if parts[-1:] == ["cancel"]
        else {"GET": message_batch_results}
        if parts[-1:] == ["results"]
        else {},
    }
    methods = routes.get(len(parts))
    if not methods:
        return await respond_error(reply, MESSAGES, unknown_url(request, retry=None))
    handler = methods.get(request.method)
    if handler is None:
        return await respond_error(reply, MESSAGES, method_not_allowed(request, ", ".join(methods), retry=None))
    await answering_errors(reply, MESSAGES, handler(request, reply, *parts[:1]))


def _base(request: Request) -> str:
    scheme = "https" if request.scope.get("scheme") == "https" else "http"
    return f"{scheme}://{request.header('host') or 'localhost'}"


async def message_batch_new(request: Request, reply: Reply) -> None:
    body = parse_body(request.body)
    requests = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(requests, list) or not 1 <= len(requests) <= ANTHROPIC_MAX_REQUESTS:
        raise bad_request(f"'requests' must be a list of 1 to {ANTHROPIC_MAX_REQUESTS} requests.", "requests")
    seen: set[str] = set()
    for index, item in enumerate(requests):
        where = f"requests[{index}]"
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 64 or not set(custom_id) <= CUSTOM_ID_CHARS:
            raise bad_request(f"{where}.custom_id must be 1 to 64 letters, digits, '_' or '-'.", f"{where}.custom_id")
        if custom_id in seen:
            raise bad_request(f"{where}.custom_id {custom_id!r} is used more than once.", f"{where}.custom_id")
        seen.add(custom_id)
        if not isinstance(item.get("params"), dict):
            raise bad_request(f"{where}.params must be an object.", f"{where}.params")
    caller = await _caller(request, MESSAGES)
    lines = [checked_line(n, r["custom_id"], r["params"], MESSAGES) for n, r in enumerate(requests, start=1)]
    batch = await _created(request, _anthropic_create, caller=caller, lines=lines)
    await reply.json(200, message_batch_object(batch, await db(batch_counts, batch=batch), base=_base(request)))


def _anthropic_create(*, caller: Caller, lines: list[CheckedLine], trace: dict[str, str] | None) -> Batch:
    batch = batch_create(
        id_prefix="msgbatch_",
        api=Batch.Api.ANTHROPIC,
        team=caller.team,
        user=caller.user,
        key=caller.key,
        endpoint=ANTHROPIC_ENDPOINT,
        input_file_id="",
        window=WINDOWS["24h"],
        completion_window="24h",
        metadata=None,
        lines=lines,
        now=timezone.now(),
        trace=trace,
    )
    if batch.status == Batch.Status.FAILED:  # never: its requests were checked above
        raise InvalidInput(batch.errors["data"] if batch.errors else [])
    return batch


async def message_batches_list(request: Request, reply: Reply) -> None:
    caller = await _caller(request, MESSAGES)
    limit = _limit(request, default=20, most=1000)
    found = await db(
        batches_of, team=caller.team, api=Batch.Api.ANTHROPIC, after=request.param("after_id"), limit=limit + 1
    )
    data = [message_batch_object(b, await db(batch_counts, batch=b), base=_base(request)) for b in found[:limit]]
    await reply.json(
        200,
        {
            "data": data,
            "has_more": len(found) > limit,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        },
    )


async def message_batch_retrieve(request: Request, reply: Reply, batch_id: str) -> None:
    caller = await _caller(request, MESSAGES)
    batch = await db(batch_for, team=caller.team, batch_id=batch_id, api=Batch.Api.ANTHROPIC)
    await reply.json(200, message_batch_object(batch, await db(batch_counts, batch=batch), base=_base(request)))


async def message_batch_stop(request: Request, reply: Reply, batch_id: str) -> None:
    caller = await _caller(request, MESSAGES)
    batch = await db(
        batch_cancel, team=caller.team, batch_id=batch_id, api=Batch.Api.ANTHROPIC, by=caller.user, now=timezone.now()
    )
    await reply.json(200, message_batch_object(batch, await db(batch_counts, batch=batch), base=_base(request)))


async def message_batch_results(request: Request, reply: Reply, batch_id: str) -> None:
    caller = await _caller(request, MESSAGES)
    batch = await db(batch_for, team=caller.team, batch_id=batch_id, api=Batch.Api.ANTHROPIC)
    if batch.body_removed_at is not None:
        raise GatewayError(
            404,
            f"Batch {batch_id}'s results were removed by retention (its team's body_retention_hours).",
            code="not_found_error",
        )
    if not batch.output_file_id:
        raise GatewayError(
            404 if batch.status != Batch.Status.IN_PROGRESS else 400,
            f"Batch {batch_id} has not ended: its results are not ready.",
            code="not_found_error",
        )
    found = await db(file_for, team=caller.team, file_id=batch.output_file_id)
    await _stream_file(reply, found.pk, size=found.bytes)
