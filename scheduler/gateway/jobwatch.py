"""The job API's long-lived requests, token or session authenticated like the rest of /api/:

* `GET /api/jobs/{id}/wait/?timeout=S` answers when the job ends or the timeout passes (at most
  300 s), with the job as `GET /api/jobs/{id}/` shows it.
* `GET /api/jobs/{id}/stream/` is a Server-Sent Events stream: `job` (the job now), then `event` for
  each of its events (with the event's id as the SSE id, so a client that reconnects with
  `Last-Event-ID` gets only newer ones), `status` when the status changes, `delta` for each piece
  of a streamed job's output (`{"attempt", "offset", "text"}`) as the worker receives it, and
  `done` with the final job, after which the stream ends. Deltas come in order, each starting where
  the last ended (a stream opened while the model writes starts where it joined); a retried job's
  next attempt starts again at offset 0; output still on its way when the job ended comes as one
  last delta before `done`. A comment every 15 s keeps idle
  connections open. Leaving the stream does not cancel the job.

  A flow submitted with `stream: true` streams every round (relay.py's RoundRelay): `delta`
  (`{"round", "attempt", "offset", "text"}`) for a round's text and `tool_call` (`{"round",
  "attempt", "index", "id", "name", "offset", "text"}`) for a piece of a tool call's arguments,
  offsets counted per round and attempt; each round's pieces end before its `round_finished`
  event, what the stream missed of them completed there from the round's recorded answer. For
  such a flow every SSE id is a cursor (`<event id>[.<round>.<attempt>.<text sent>.<tool 0
  sent>...]`), so Last-Event-ID resumes exactly where the client was. A chat's stream is as above.

Opening either counts against the caller's TELEMACHUS_STREAM_RATE: past it, 429 `throttled` with
Retry-After, in the REST API's shape.

Both wake on the process's job feed (scheduler/notify/feed.py) instead of polling the database."""

import asyncio
import json
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone
from rest_framework.utils.encoders import JSONEncoder

from scheduler.api.serializers import JobEventOutput, JobOutput
from scheduler.connections import db, idempotent
from scheduler.gateway.asgi import Reply, Request, api_error
from scheduler.gateway.auth import CredentialRefused, TooManyFailures, client_address, credential_for, user_for_session
from scheduler.gateway.relay import Relay, RoundRelay
from scheduler.models import Job, JobEvent
from scheduler.notify.feed import Delta, JobFeed
from scheduler.rbac import visible_jobs
from scheduler.services.retention import body_hold, job_missing, team_holds
from telemachus.http.throttles import caller_ident, rate_parse, rate_take
from telemachus.teams import rbac

DEFAULT_TIMEOUT, MAX_TIMEOUT = 30.0, 300.0
KEEPALIVE_SECONDS = 15.0
# A waiter's hold on a body outlasts its wait by this much, for the read that ends it.
HOLD_MARGIN_SECONDS = 5.0
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}


async def serve(request: Request, reply: Reply, job_id: str, action: str) -> None:
    if request.method != "GET":
        return await reply.json(
            405, api_error(405, "method_not_allowed", f'Method "{request.method}" not allowed.'), {"allow": "GET"}
        )
    try:
        user, wait = await db(
            _caller,
            authorization=request.header("authorization"),
            session_key=request.cookie(settings.SESSION_COOKIE_NAME),
            address=client_address(request.scope),
        )
    except TooManyFailures as exc:
        return await reply.json(
            429,
            {**api_error(429, "throttled", str(exc)), "retry_after": exc.retry_after},
            {"retry-after": str(exc.retry_after)},
        )
    except CredentialRefused as exc:
        return await reply.json(401, api_error(401, "not_authenticated", str(exc)), {"www-authenticate": "Token"})
    if user is None:
        return await reply.json(
            401,
            api_error(401, "not_authenticated", "Authentication credentials were not provided."),
            {"www-authenticate": "Token"},
        )
    if wait is not None:
        detail = f"Request was throttled. Expected available in {wait} seconds."
        return await reply.json(
            429, {**api_error(429, "throttled", detail), "retry_after": wait}, {"retry-after": str(wait)}
        )
    if action == "wait":
        await job_wait(request, reply, user=user, job_id=int(job_id))
    else:
        await job_stream(request, reply, user=user, job_id=int(job_id))


@idempotent
def _caller(
    *, authorization: str | None, session_key: str | None, address: str
) -> tuple[rbac.Principal | None, int | None]:
    """Who is calling, and how long they must wait (TELEMACHUS_STREAM_RATE: each wait or stream
    opened counts), or None when they may go on."""
    user = _user(authorization=authorization, session_key=session_key, address=address)
    rate = rate_parse(settings.TELEMACHUS_STREAM_RATE)
    if user is None or rate is None:
        return user, None
    return user, rate_take(scope="stream", ident=caller_ident(user, None), rate=rate)


def _user(*, authorization: str | None, session_key: str | None, address: str) -> rbac.Principal | None:
    """The key's or token's user; or, with no Authorization header, the session's. A bad token is
    refused even when a session cookie came along."""
    if authorization:
        credential = credential_for(authorization=authorization, address=address)
        return credential.user if credential is not None else None
    return user_for_session(session_key=session_key) if session_key else None


def _not_found(job_id: int) -> dict[str, Any]:
    return api_error(404, "not_found", job_missing(job_id))


async def job_wait(request: Request, reply: Reply, *, user: rbac.Principal, job_id: int) -> None:
    try:
        timeout = float(request.param("timeout") or DEFAULT_TIMEOUT)
        if not 0 <= timeout <= MAX_TIMEOUT:
            raise ValueError
    except ValueError:
        return await reply.json(
            400,
            {
                **api_error(400, "validation_error", "Invalid input."),
                "fields": {"timeout": [f"A number of seconds from 0 to {MAX_TIMEOUT:.0f}."]},
            },
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    with JobFeed.current().watch(job_id) as watch:
        # Keep its answer past an early body removal until this wait ends (and a little after,
        # for the last read), held before the first read so an end seen by it cannot lose it.
        await db(_hold, user=user, job_id=job_id, seconds=timeout + HOLD_MARGIN_SECONDS)
        data = None
        while True:
            _, maybe_ended, _ = watch.take()
            if maybe_ended or data is None:
                data = await db(_job_data, user=user, job_id=job_id)
                if data is None:
                    return await reply.json(404, _not_found(job_id))
                if data["status"] in Job.TERMINAL:
                    break
            if not await watch.wait(deadline - loop.time(), unless=reply.gone):
                if reply.gone.done():
                    return
                data = await db(_job_data, user=user, job_id=job_id)
                if data is None:
                    return await reply.json(404, _not_found(job_id))
                break
    await reply.json(200, data)


async def job_stream(request: Request, reply: Reply, *, user: rbac.Principal, job_id: int) -> None:
    try:
        after, rounds = RoundRelay.resume(request.header("last-event-id") or "0")
    except ValueError:
        after, rounds = 0, None
    relay = Relay(exact=False)
    with JobFeed.current().watch(job_id, deltas=True) as watch:
        watch.take()
        # Its answer is kept past an early body removal while the stream lasts, renewed at each
        # keepalive, only when there is one to keep.
        holding = await db(_hold, user=user, job_id=job_id, seconds=KEEPALIVE_SECONDS + HOLD_MARGIN_SECONDS)
        snapshot = await db(_snapshot, user=user, job_id=job_id, after=after)
        if snapshot is None:
            return await reply.json(404, _not_found(job_id))
        data, events, answers = snapshot
        if not _streamed_flow(data):
            rounds = None
        elif rounds is None:
            rounds = RoundRelay(closed=await db(_rounds_closed, job_id=job_id, after=after))
        await reply.start(200, SSE_HEADERS)
        await reply.write(_sse("job", data))
        status = data["status"]

        async def send_events() -> None:
            nonlocal after
            for event in events:
                if rounds is not None and event["event"] == JobEvent.Type.ROUND_FINISHED:
                    meta = event["meta"] or {}
                    round_no = int(meta.get("round") or 0)
                    for delta, cursor in rounds.close(round_no, meta.get("attempt"), answers.get(round_no), after):
                        await reply.write(_round_delta(delta, cursor))
                after = event["id"]
                await reply.write(_sse("event", event, ident=rounds.cursor(after) if rounds is not None else after))

        while True:
            await send_events()
            if data["status"] != status:
                status = data["status"]
                await reply.write(_sse("status", {"status": status}))
            if status in Job.TERMINAL:
                streamed_chat = rounds is None and data["input"].get("stream") and status == Job.Status.DONE
                rest = relay.rest(data["result"]) if streamed_chat else None
                if rest:  # output still on its way, or sent before this stream opened
                    await reply.write(
                        _delta(Delta(relay.attempt or data["attempts"], relay.base + len(relay.sent), rest))
                    )
                return await reply.end(_sse("done", data))
            events = []
            while not events and data["status"] == status:
                if not await watch.wait(KEEPALIVE_SECONDS, unless=reply.gone):
                    if reply.gone.done():
                        return
                    await reply.write(b": keepalive\n\n")
                    if holding:
                        seconds = KEEPALIVE_SECONDS + HOLD_MARGIN_SECONDS
                        holding = await db(_hold, user=user, job_id=job_id, seconds=seconds)
                    continue
                changed, _, deltas = watch.take()
                if rounds is not None and rounds.behind(deltas):
                    # A round after the open one writes: the open one ended; its end (and the rest
                    # of its output) goes first.
                    snapshot = await db(_snapshot, user=user, job_id=job_id, after=after)
                    if snapshot is None:
                        return await reply.end()
                    data, events, answers = snapshot
                    await send_events()
                    events, changed = [], False
                if rounds is not None:
                    for delta, cursor in rounds.accept(deltas, after):
                        await reply.write(_round_delta(delta, cursor))
                else:
                    for delta in relay.accept(deltas):
                        await reply.write(_delta(delta))
                if changed:
                    snapshot = await db(_snapshot, user=user, job_id=job_id, after=after)
                    if snapshot is None:  # deleted, or no longer visible to this user
                        return await reply.end()
                    data, events, answers = snapshot


def _streamed_flow(data: dict[str, Any]) -> bool:
    return data["type"] == Job.Type.FLOW and bool(data["input"].get("stream"))


def _delta(delta: Delta) -> bytes:
    return _sse("delta", {"attempt": delta.attempt, "offset": delta.offset, "text": delta.text})


def _round_delta(delta: Delta, cursor: str) -> bytes:
    """A flow round's piece: `delta` (its text) or `tool_call` (a piece of a tool call's arguments),
    with the stream's cursor as its SSE id."""
    if not delta.part:
        data = {"round": delta.round, "attempt": delta.attempt, "offset": delta.offset, "text": delta.text}
        return _sse("delta", data, ident=cursor)
    tool_call = {
        "round": delta.round,
        "attempt": delta.attempt,
        "index": int(delta.part.removeprefix("tool:")),
        "id": delta.id,
        "name": delta.name,
        "offset": delta.offset,
        "text": delta.text,
    }
    return _sse("tool_call", tool_call, ident=cursor)


def _sse(event: str, data: Any, *, ident: int | str | None = None) -> bytes:
    head = f"id: {ident}\n" if ident is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, cls=JSONEncoder)}\n\n".encode()


@idempotent
def _hold(*, user: rbac.Principal, job_id: int, seconds: float) -> bool:
    """Hold the job's body for `seconds` from now, if the user may see it (scheduler/services/retention.py)."""
    # One read for most jobs: a team that keeps its jobs and their bodies long has nothing to hold.
    kept = visible_jobs(user).filter(team_holds(), pk=job_id, body_removed_at=None)
    if not kept.exists():
        return False
    return body_hold(job_id=job_id, until=timezone.now() + timedelta(seconds=seconds))


@idempotent
def _job_data(*, user: rbac.Principal, job_id: int) -> dict[str, Any] | None:
    job = visible_jobs(user).select_related("team", "user", "executor").filter(pk=job_id).first()
    return None if job is None else JobOutput(job).data


@idempotent
def _snapshot(
    *, user: rbac.Principal, job_id: int, after: int
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[int, dict[str, Any]]] | None:
    """The job as the API shows it, its events newer than `after`, and, for a streamed flow whose
    rounds end among those events, those rounds' recorded answers by round (read after the events,
    so each is there)."""
    data = _job_data(user=user, job_id=job_id)
    if data is None:
        return None
    events = JobEvent.objects.filter(job_id=job_id, pk__gt=after).select_related("executor").order_by("pk")
    shown: list[dict[str, Any]] = JobEventOutput(events, many=True).data  # type: ignore[assignment]
    ended = [e["meta"].get("round") for e in shown if e["event"] == JobEvent.Type.ROUND_FINISHED]
    answers: dict[int, dict[str, Any]] = {}
    if ended and _streamed_flow(data):
        conversation = Job.objects.filter(pk=job_id).values_list("conversation", flat=True).first() or []
        said = [message for message in conversation if message.get("role") == "assistant"]
        answers = {round_no: said[round_no - 1] for round_no in ended if 0 < round_no <= len(said)}
    return data, shown, answers


@idempotent
def _rounds_closed(*, job_id: int, after: int) -> int:
    """How many of a flow's rounds ended at or before event `after` (a client that has that event
    has their output whole)."""
    return JobEvent.objects.filter(job_id=job_id, pk__lte=after, event=JobEvent.Type.ROUND_FINISHED).count()
