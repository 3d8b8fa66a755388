"""One governed model call, whatever protocol the app speaks: the part the three model APIs of the
gateway share (OpenAI's chat completions and Responses, Anthropic's Messages; openai/,
responses/, anthropic/).

`model_call()` authenticates the caller, picks the team, checks the `openai` feature switch
(caller.py), has
the protocol's `Dialect` translate the body into a chat completion, submits it as a `chat` job
through `job_submit` (RBAC, budgets, priority map, depth cap), claims it in this process when it
can run now (onehop.py: the workers' claim, only when it would take this job next), then waits for
the job (its own run's end, or a worker's) on the process's job feed, holding no thread and no
database connection, and answers in the protocol's shape: one body, or a stream the dialect's
`StreamWriter` writes as the output arrives. A client that disconnects, or a call that waits
longer than TELEMACHUS_GATEWAY_TIMEOUT_SECONDS (504), cancels its job, which frees its slot at
once. Every response about a job names it in `X-Telemachus-Job`.

A dialect (dialect.py) says only what differs: how a body becomes a chat completion (refusing
what it cannot carry), how a result, a stream and an error look. Queueing, waiting, relaying and
canceling are here, once."""

import asyncio
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, replace
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from executors.contract import EMBEDDINGS_API
from quotas.models import ZERO, money_text
from scheduler.connections import db, idempotent
from scheduler.gateway import onehop
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.auth import client_address
from scheduler.gateway.caller import TEAM_HEADER, Caller, caller_for
from scheduler.gateway.dialect import (
    JOB_HEADER,
    SSE_HEADERS,
    Dialect,
    ModelCall,
    StreamWriter,
    parse_body,
    respond_error,
)
from scheduler.gateway.errors import INTERRUPTED, GatewayError, bad_request, from_domain, job_failure
from scheduler.gateway.relay import Relay
from scheduler.models import Job, JobEvent
from scheduler.notify.feed import Delta, JobFeed, Watch
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.retention import body_hold_release
from scheduler.services.submit import BUDGET_FAIL, MAX_QUEUE_SECONDS, job_submit
from telemachus import errors, tracing
from telemachus.control.features import OPENAI
from telemachus.db.compiled import CompiledQuery
from telemachus.teams import rbac

if TYPE_CHECKING:
    from opentelemetry.context import Context

log = logging.getLogger("telemachus.gateway")
PRIORITY_HEADER = "x-telemachus-priority"
COST_HEADER, CURRENCY_HEADER = "x-telemachus-cost", "x-telemachus-currency"
# What an answer spent waiting for a slot, and what Telemachus added besides that and the model
# call (authentication, the submit, the claim, the finish, relaying): docs/routing.md.
QUEUE_MS_HEADER, OVERHEAD_MS_HEADER = "x-telemachus-queue-ms", "x-telemachus-overhead-ms"
# A conversation's calls share a session, so each prefers the executor that served the last one.
SESSION_HEADER, SESSION_MAX_LENGTH = "x-telemachus-session", 200
# How long the call may wait for a slot (requirements.max_queue_seconds; docs/routing.md).
MAX_QUEUE_HEADER = "x-telemachus-max-queue-seconds"
KEEPALIVE_SECONDS = 15.0
# Enforce a queue deadline this long after it, so the database's clock has passed it.
DEADLINE_MARGIN = 0.01


def _submit(
    *,
    authorization: str | None,
    team: str | None,
    priority: str | None,
    body: bytes,
    dialect: Dialect,
    address: str,
    wake: bool,
    session: str | None = None,
    trace: "Context | None" = None,
    max_queue: str | None = None,
) -> tuple[Caller, Job, ModelCall]:
    """Authenticate, translate and check the body, submit: one trip to the database threads.
    `wake` False: the workers are not woken, since the call is claimed in this process next.
    `trace`: the request span's context, made current in this database thread, so the submit's
    span is its child (and the job keeps the trace: scheduler/services/submit.py)."""
    if trace is not None:
        with tracing.within(trace):
            return _submit(
                authorization=authorization,
                team=team,
                priority=priority,
                body=body,
                dialect=dialect,
                address=address,
                wake=wake,
                session=session,
                max_queue=max_queue,
            )
    caller = caller_for(
        authorization=authorization, team=team, confirm=False, address=address, api_key_header=dialect.api_key_header
    )
    session = _session(session)
    data = parse_body(body)
    call = dialect.translate(data)
    # A call's caller holds its connection: a budget spent while it waits answers 429 at once.
    requirements = {"model": call.model, "est_tokens": call.est_tokens, "on_budget_exhausted": BUDGET_FAIL}
    if call.api == EMBEDDINGS_API:
        requirements["api"] = EMBEDDINGS_API
    if max_queue is not None:
        requirements["max_queue_seconds"] = _max_queue(max_queue)
    # The team again by name, or None: the submit chooses the caller's only team from the
    # configuration its statement confirms, not from the unconfirmed snapshot `caller` came from.
    job = job_submit(
        user=caller.user,
        team=team,
        type=Job.Type.CHAT,
        requirements=requirements,
        input=call.input,
        priority=_priority(priority),
        meta={"via": dialect.via},
        features=(OPENAI,),
        key=caller.key,
        wake=wake,
        affinity_key=session,
        # The caller waits for the answer: if its team removes bodies early, this one is kept
        # until the call is answered (`_model_call` releases it) or times out.
        body_hold_seconds=settings.TELEMACHUS_GATEWAY_TIMEOUT_SECONDS,
    )
    return replace(caller, team=job.team), job, call


def _session(header: str | None) -> str:
    """X-Telemachus-Session: any printable name the app gives a conversation, up to 200 characters."""
    value = (header or "").strip()
    if len(value) > SESSION_MAX_LENGTH or not value.isprintable():
        raise bad_request(
            f"X-Telemachus-Session must be printable and at most {SESSION_MAX_LENGTH} characters.", SESSION_HEADER
        )
    return value


def _max_queue(header: str) -> float:
    """X-Telemachus-Max-Queue-Seconds: a number of seconds from 0 to a day."""
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_QUEUE_SECONDS:
        raise bad_request(
            f"X-Telemachus-Max-Queue-Seconds must be a number of seconds from 0 to {MAX_QUEUE_SECONDS}.",
            MAX_QUEUE_HEADER,
        )
    return value


def _priority(header: str | None) -> int:
    if header is None:
        return 0
    try:
        value = int(header)
    except ValueError:
        value = Job.PRIORITY_MAX + 1
    if not Job.PRIORITY_MIN <= value <= Job.PRIORITY_MAX:
        raise bad_request(
            f"X-Telemachus-Priority must be an integer from {Job.PRIORITY_MIN} to {Job.PRIORITY_MAX}.", PRIORITY_HEADER
        )
    return value


# --- how a job ended -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ending:
    status: str
    result: dict[str, Any] | None
    error: str
    upstream_status: int | None = None
    timed_out: bool = False
    cost: Decimal = ZERO
    # The refusal a job that never ran ended with (the scheduler's error body: a budget spent
    # while it waited, scheduler/services/claim.py `_budget_refusals`): answered as if the submit
    # had refused it.
    refusal: dict[str, Any] | None = None
    # A done job's wait for its slot and its model call, in seconds, when known.
    queued: float | None = None
    model: float | None = None

    def timings(self, *, since: float) -> dict[str, str]:
        """X-Telemachus-Queue-Ms and X-Telemachus-Overhead-Ms of an answer to a call that came
        at `since` (time.monotonic()): the wait for a slot, and the rest of the call's time that
        was not the model's; none when the parts are not known."""
        if self.queued is None or self.model is None:
            return {}
        total = time.monotonic() - since
        overhead = max(total - self.queued - self.model, 0.0)
        return {QUEUE_MS_HEADER: f"{self.queued * 1000:.1f}", OVERHEAD_MS_HEADER: f"{overhead * 1000:.1f}"}

    def failure(self) -> GatewayError:
        if self.refusal is not None:
            return from_domain(errors.domain_error_from(self.refusal))
        return job_failure(
            status=self.status, error=self.error, upstream_status=self.upstream_status, timed_out=self.timed_out
        )


@idempotent
def _ending(*, job_id: int) -> Ending | None:
    """The job's end, or None while it has not ended: one read, the job with its ending event's
    details (a done job's model time, a failed one's upstream status) on this path only, a call a
    worker ran (one this process ran answers from its flight). A second read of the event cost
    every such call a round trip, under load a sixth of the API process's database time."""
    row = _ENDING.first(job_id=job_id)
    if row is None or row[0] not in Job.TERMINAL:
        return None
    state, result, error, cost, submitted, started, ending = row
    meta = ending if isinstance(ending, dict) else {}
    if state == Job.Status.DONE:
        seconds = meta.get("seconds")
        return Ending(
            status=state,
            result=result,
            error=error,
            cost=cost,
            queued=max((started - submitted).total_seconds(), 0.0) if started and submitted else None,
            model=float(seconds) if isinstance(seconds, int | float) else None,
        )
    if state != Job.Status.FAILED:
        return Ending(status=state, result=result, error=error, cost=cost)
    status = meta.get("status")
    return Ending(
        status=state,
        result=None,
        error=error,
        upstream_status=status if isinstance(status, int) else None,
        timed_out=bool(meta.get("timed_out")),
        refusal=meta.get("refusal") if isinstance(meta.get("refusal"), dict) else None,
    )


# The job, with the details of its last `finished` or `failed` event (jobevent_job_idx); compiled
# once (telemachus/db/compiled.py): built at every call, this query cost more than it saved.
_ENDING: CompiledQuery[tuple[Any, ...]] = CompiledQuery(
    lambda job_id: (
        Job.objects.filter(pk=job_id)
        .annotate(
            ending=Subquery(
                JobEvent.objects.filter(job_id=OuterRef("pk"), event__in=(JobEvent.Type.FINISHED, JobEvent.Type.FAILED))
                .order_by("-id")
                .values("meta")[:1]
            )
        )
        .values_list("status", "result", "error", "cost", "submitted_at", "started_at", "ending")
    )
)


@idempotent
def _cancel(*, job_id: int, user: rbac.Principal, reason: str) -> Ending | None:
    """Cancel a job its caller no longer waits for, saying why; if it ended first, how it ended."""
    try:
        job_cancel(job_id=job_id, by=user, reason=reason)
    except errors.Conflict:
        return _ending(job_id=job_id)
    return None


async def _next_ending(watch: Watch, flight: onehop.Call | None) -> tuple[Ending | None, list[Delta]]:
    """What the watch has: output, and the job's end if a change may have ended it (from the
    flight's own finish when this process ran the job and it was answered, with no read). While
    this process is writing the flight's finish, the job ends through it: a notification of that
    end heard first is not read, since the flight's end wakes the watch again."""
    _, maybe_ended, deltas = watch.take()
    if flight is not None and flight.answered:
        return (
            Ending(
                status=Job.Status.DONE,
                result=flight.result,
                error="",
                cost=flight.cost or ZERO,
                model=flight.seconds,
            ),
            deltas,
        )
    if flight is not None and flight.finishing and not flight.settled:
        return None, deltas
    ending = await db(_ending, job_id=watch.job_id) if maybe_ended else None
    return ending, deltas


@idempotent
def _queued(*, job_id: int) -> float | None:
    """Seconds the job waited for its slot (submit to start); None before it started."""
    row = Job.objects.filter(pk=job_id).values_list("submitted_at", "started_at").first()
    if row is None or row[0] is None or row[1] is None:
        return None
    return max((row[1] - row[0]).total_seconds(), 0.0)


def _deadline() -> float:
    return asyncio.get_running_loop().time() + settings.TELEMACHUS_GATEWAY_TIMEOUT_SECONDS


def _left(deadline: float) -> float:
    return deadline - asyncio.get_running_loop().time()


LEFT = "client disconnected"


def _waited_too_long() -> str:
    return f"timed out after {settings.TELEMACHUS_GATEWAY_TIMEOUT_SECONDS:g} s"


def _why(reply: Reply) -> str:
    """Why a wait that ended without news gives up: its client left, or its time is up."""
    return LEFT if reply.gone.done() else _waited_too_long()


def _timeout() -> GatewayError:
    return GatewayError(
        504,
        f"No answer within {settings.TELEMACHUS_GATEWAY_TIMEOUT_SECONDS:g} s; the job was canceled.",
        type="api_error",
        code="timeout",
        retry=False,
    )


# --- the call ------------------------------------------------------------------------------------


async def model_call(request: Request, reply: Reply, *, dialect: Dialect) -> None:
    """Serve one model call in `dialect`: submit its job, wait for it, answer (see the module
    docstring). Errors before the answer starts are raised (GatewayError, DomainError) for the
    protocol's `serve` to render; a stream that has started ends with the dialect's failure event.
    While tracing, the call is a span (kind SERVER) continuing the caller's `traceparent`."""
    if not tracing.active:
        return await _model_call(request, reply, dialect=dialect, trace=None)
    with tracing.span(
        f"{request.method} {request.path}",
        parent=tracing.context_from_headers(request.headers),
        server=True,
        attributes={"http.request.method": request.method, "url.path": request.path, "telemachus.via": dialect.via},
    ):
        return await _model_call(request, reply, dialect=dialect, trace=tracing.current_context())


async def _model_call(request: Request, reply: Reply, *, dialect: Dialect, trace: "Context | None") -> None:
    arrived = time.monotonic()
    feed = JobFeed.current()
    mark = feed.mark()
    created = int(time.time())
    hop = onehop.enabled()
    caller, job, call = await db(
        _submit,
        authorization=dialect.authorization(request),
        team=request.header(TEAM_HEADER),
        priority=request.header(PRIORITY_HEADER),
        session=request.header(SESSION_HEADER),
        max_queue=request.header(MAX_QUEUE_HEADER),
        body=request.body,
        dialect=dialect,
        address=client_address(request.scope),
        wake=not hop,
        trace=trace,
    )
    if trace is not None:
        tracing.current_span().set_attributes(
            {"telemachus.job.id": job.pk, "telemachus.team": caller.team.slug, "gen_ai.request.model": call.model}
        )
    submitted = time.monotonic()
    try:
        await _call(reply, feed, mark, hop, caller, job, call, dialect, created, trace, arrived, submitted)
    finally:
        if job.body_hold_until is not None:
            await db(body_hold_release, job_id=job.pk)


async def _call(
    reply: Reply,
    feed: JobFeed,
    mark: tuple[int, int] | None,
    hop: bool,
    caller: Caller,
    job: Job,
    call: ModelCall,
    dialect: Dialect,
    created: int,
    trace: "Context | None",
    arrived: float,
    submitted: float,
) -> None:
    """The call once submitted: claimed here or by a worker, waited for, answered."""
    with feed.watch(job.pk, deltas=call.stream, since=mark) as watch:
        own = onehop.OwnCalls.current() if hop else None
        flight = await own.claim(job.pk) if own is not None else None
        claimed = time.monotonic() - submitted  # a call this process runs waited only for its claim
        enforcer = (
            asyncio.create_task(_deadline_enforce(job.queue_deadline), name=f"deadline-{job.pk}")
            if flight is None and job.queue_deadline is not None
            else None
        )
        try:
            if call.stream:
                writer = dialect.writer(job_id=job.pk, created=created, call=call)
                queued = claimed if flight is not None else None
                return await _relay(reply, watch, flight, caller, dialect, writer, queued)
            ending = await _wait(reply, watch, flight, caller, dialect)
        finally:
            if own is not None and flight is not None:
                own.abort(flight.job_id, "its call ended")  # a no-op once it has finished
            if enforcer is not None:
                enforcer.cancel()
    if ending is None:
        return
    if ending.status != Job.Status.DONE:
        if trace is not None:
            tracing.span_failed(tracing.current_span(), f"the job ended {ending.status}: {ending.error}"[:500])
        return await respond_error(reply, dialect, ending.failure(), job.pk)
    if flight is not None and ending.queued is None:
        ending = replace(ending, queued=claimed)
    try:
        body = dialect.answer(job_id=job.pk, created=created, call=call, result=ending.result or {})
    except GatewayError as exc:
        return await respond_error(reply, dialect, exc, job.pk)
    await reply.json(
        200,
        body,
        {
            JOB_HEADER: str(job.pk),
            COST_HEADER: money_text(ending.cost),
            CURRENCY_HEADER: settings.TELEMACHUS_CURRENCY,
            **ending.timings(since=arrived),
        },
    )


async def _deadline_enforce(deadline: datetime) -> None:
    """At a queued call's queue deadline, a claim that takes nothing (scheduler/services/routes.py
    `routes_sweep` runs in every claim): the call moves to its route's next free model or ends 429
    then, even when every worker is busy or none has claimed since. Its end reaches the call's
    watch as any end does."""
    await asyncio.sleep(max((deadline - timezone.now()).total_seconds(), 0.0) + DEADLINE_MARGIN)
    try:
        await db(_deadline_claim)
    except Exception as exc:  # the workers' claims enforce it too
        log.warning("enforcing a queue deadline failed (%s); left to the workers", exc)


def _deadline_claim() -> None:
    job_claim(worker=f"api:{socket.gethostname()}:{os.getpid()}", only=frozenset(), limit=0)


async def _wait(
    reply: Reply, watch: Watch, flight: onehop.Call | None, caller: Caller, dialect: Dialect
) -> Ending | None:
    """A plain call's wait for its job's end; None when it was answered already (the client
    left, or the wait timed out)."""
    deadline = _deadline()
    while True:
        ending, _ = await _next_ending(watch, flight)
        if ending is not None:
            return ending
        if not await watch.wait(_left(deadline), unless=reply.gone):
            ending = await db(_cancel, job_id=watch.job_id, user=caller.user, reason=_why(reply))
            if reply.gone.done():
                log.info("job %d: client left; canceled", watch.job_id)
                return None
            if ending is None:
                await respond_error(reply, dialect, _timeout(), watch.job_id)
                return None
            return ending


async def _relay(
    reply: Reply,
    watch: Watch,
    flight: onehop.Call | None,
    caller: Caller,
    dialect: Dialect,
    writer: StreamWriter,
    queued: float | None,
) -> None:
    """A streamed call. The response starts with the first output (or the job's end), so a job that
    fails before answering gets a real status (502, 504) instead of an error inside a 200 stream.
    Its headers leave before the answer: they say the job and its wait for a slot (`queued`
    seconds for a call this process claimed, else read from the job, which has started by then),
    never its cost or overhead, which are known only at its end."""
    job_id, deadline, relay = watch.job_id, _deadline(), Relay(exact=True)
    while True:
        ending, deltas = await _next_ending(watch, flight)
        text = "".join(piece.text for piece in relay.accept(deltas))
        tools = relay.take_tools()
        if text or tools or ending is not None:
            break
        if not await watch.wait(_left(deadline), unless=reply.gone):
            ending = await db(_cancel, job_id=job_id, user=caller.user, reason=_why(reply))
            if reply.gone.done():
                return
            if ending is None:
                return await respond_error(reply, dialect, _timeout(), job_id)
            break
    if not text and not tools and ending is not None and ending.status != Job.Status.DONE:
        return await respond_error(reply, dialect, ending.failure(), job_id)
    if queued is None:
        queued = await db(_queued, job_id=job_id)
    timing = {QUEUE_MS_HEADER: f"{queued * 1000:.1f}"} if queued is not None else {}
    await reply.start(200, {**SSE_HEADERS, JOB_HEADER: str(job_id), **timing})
    await reply.write(writer.opening(text) + b"".join(writer.tool(piece) for piece in tools))
    while ending is None:
        if relay.broken:
            await db(
                _cancel,
                job_id=job_id,
                user=caller.user,
                reason="stream interrupted: the model's stream broke off after part of the answer was relayed",
            )
            return await reply.end(writer.failure(INTERRUPTED))
        if not await watch.wait(min(_left(deadline), KEEPALIVE_SECONDS), unless=reply.gone):
            if reply.gone.done():
                await db(_cancel, job_id=job_id, user=caller.user, reason=LEFT)
                log.info("job %d: client left its stream; canceled", job_id)
                return
            if _left(deadline) <= 0:
                ending = await db(_cancel, job_id=job_id, user=caller.user, reason=_waited_too_long())
                if ending is None:
                    return await reply.end(writer.failure(_timeout()))
                break
            await reply.write(writer.keepalive)
            continue
        ending, deltas = await _next_ending(watch, flight)
        text = "".join(piece.text for piece in relay.accept(deltas))
        output = (writer.text(text) if text else b"") + b"".join(writer.tool(p) for p in relay.take_tools())
        if output:
            await reply.write(output)
    if ending.status != Job.Status.DONE:
        return await reply.end(writer.failure(ending.failure()))
    result = ending.result or {}
    rest = relay.rest(result)
    if rest is None or relay.broken:
        return await reply.end(writer.failure(INTERRUPTED))
    try:
        closing = writer.closing(result, rest)
    except GatewayError as exc:
        return await reply.end(writer.failure(exc))
    await reply.end(closing)
