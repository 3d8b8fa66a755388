"""One governed model call, whatever protocol the app speaks: the part the three model APIs of the
gateway share (OpenAI's chat completions and Responses, Anthropic's Messages; openai.py,
responses/, anthropic/).

`model_call()` authenticates the caller, picks the team, checks the `openai` feature switch, has
the protocol's `Dialect` translate the body into a chat completion, submits it as a `chat` job
through `job_submit` (RBAC, budgets, priority map, depth cap), claims it in this process when it
can run now (onehop.py: the workers' claim, only when it would take this job next), then waits for
the job (its own run's end, or a worker's) on the process's job feed, holding no thread and no
database connection, and answers in the protocol's shape: one body, or a stream the dialect's
`StreamWriter` writes as the output arrives. A client that disconnects, or a call that waits
longer than TELEMACHUS_GATEWAY_TIMEOUT_SECONDS (504), cancels its job, which frees its slot at
once. Every response about a job names it in `X-Telemachus-Job`.

A dialect says only what differs: how a body becomes a chat completion (refusing what it cannot
carry), how a result, a stream and an error look. Queueing, waiting, relaying and canceling are
here, once."""

import asyncio
import json
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings

from executors.contract import EMBEDDINGS_API
from quotas.models import ZERO, money_text
from scheduler.core.configuration import configuration, grants
from scheduler.gateway import onehop, shapes
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.auth import TooManyFailures, client_address, credential_for
from scheduler.gateway.database import db
from scheduler.gateway.feed import Delta, JobFeed, Relay, ToolPiece, Watch
from scheduler.models import Job, JobEvent
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from telemachus import errors
from telemachus.control.config import ConfigSnapshot, config_current, config_snapshot
from telemachus.control.features import OPENAI, feature_require
from telemachus.http.throttles import caller_ident, rate_parse, rate_take
from telemachus.models import ApiKey, Team
from telemachus.teams import rbac

log = logging.getLogger("telemachus.gateway")
TEAM_HEADER, PRIORITY_HEADER, JOB_HEADER = "x-telemachus-team", "x-telemachus-priority", "x-telemachus-job"
COST_HEADER, CURRENCY_HEADER = "x-telemachus-cost", "x-telemachus-currency"
# A conversation's calls share a session, so each prefers the executor that served the last one.
SESSION_HEADER, SESSION_MAX_LENGTH = "x-telemachus-session", 200
KEEPALIVE_SECONDS = 15.0
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}
GatewayError = shapes.OpenAIError  # the gateway's errors, rendered in each protocol's shape by its dialect


# --- what differs between protocols ----------------------------------------------------------------


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

    def translate(self, body: Any) -> shapes.ModelCall:
        """The body as the chat job it becomes; raises GatewayError (400, naming the field) for what
        it cannot carry."""
        raise NotImplementedError

    def answer(self, *, job_id: int, created: int, call: shapes.ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def writer(self, *, job_id: int, created: int, call: shapes.ModelCall) -> StreamWriter:
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
    return shapes.OpenAIError(exc.status, message, type=exc.type, code=exc.code, param=name, headers=exc.headers)


async def answering_errors(reply: Reply, dialect: Dialect, handler: Any) -> None:
    """Await `handler` (a coroutine), rendering the errors it raises in the dialect's shape."""
    try:
        await handler
    except (shapes.OpenAIError, errors.DomainError) as exc:
        failure = exc if isinstance(exc, shapes.OpenAIError) else shapes.from_domain(exc)
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


# --- who is calling ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Caller:
    user: rbac.Principal
    team: Team
    key: ApiKey | None = None

    def may_call(self, model: str) -> bool:
        """Whether the caller's key (if it came with one) lets it call the model."""
        return self.key is None or not self.key.allowed_models or model in self.key.allowed_models


def caller_for(*, authorization: str | None, team: str | None, confirm: bool, address: str) -> Caller:
    """Authenticate the key or token, find the team the call acts for and refuse the call (403
    feature_disabled) if the `openai` switch is off for that team or for everyone: the one point
    every /v1/ call passes once its caller and team are known. The team, the memberships and the
    switches are the cached configuration; with `confirm` False, what this process last used,
    unconfirmed (no query), for a submit, which confirms its configuration and checks membership
    and the switch again. A refusal (no such team, not a member, switched off) is believed only
    from a confirmed read. Too many bad credentials from `address`: 429 with Retry-After. Each
    call counts against the caller's TELEMACHUS_OPENAI_RATE (429 rate_limit_exceeded past it)."""
    try:
        credential = credential_for(authorization=authorization, address=address)
    except TooManyFailures as exc:
        raise shapes.OpenAIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="too_many_authentication_failures",
            headers={"retry-after": str(exc.retry_after)},
            retry=exc.retry_after <= 60,
        ) from None
    if credential is None:
        raise shapes.not_authenticated()
    user = credential.user
    rate_require(user=user)
    snapshot, fresh = (config_snapshot(), True) if confirm else config_current()
    while True:
        try:
            found = team_of(user, team, snapshot)
            feature_require(feature=OPENAI, team=found, switches=configuration(snapshot).features)
            return Caller(user=user, team=found, key=credential.key)
        except (shapes.OpenAIError, errors.FeatureDisabled):
            if fresh:
                raise
            snapshot, fresh = config_snapshot(), True


def rate_require(*, user: rbac.Principal) -> None:
    """Count one /v1/ call against the user's (an app key's own principal's) rate, or refuse it
    with 429 and Retry-After (the SDKs wait that long and try again on their own)."""
    rate = rate_parse(settings.TELEMACHUS_OPENAI_RATE)
    wait = rate_take(scope="openai", ident=caller_ident(user, None), rate=rate) if rate is not None else None
    if wait is not None:
        raise shapes.OpenAIError(
            429,
            f"Rate limit reached: at most {settings.TELEMACHUS_OPENAI_RATE} calls; try again in {wait} s.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"retry-after": str(wait)},
        )


def team_of(user: rbac.Principal, slug: str | None, snapshot: ConfigSnapshot) -> Team:
    """The team named, if the caller may act in it (it reads as not found otherwise, as other
    teams' objects do), else the caller's only team. Read from the configuration snapshot (teams
    and memberships are configuration), so an unchanged configuration costs no query."""
    config, allowed = configuration(snapshot), grants(snapshot, user)
    if slug:
        named = config.team(slug)
        if named is None or not (allowed.operator or named.pk in allowed.roles):
            raise shapes.OpenAIError(
                404, f"No team {slug!r} that you belong to.", code="team_not_found", param=TEAM_HEADER, retry=False
            )
        return named
    mine = [config.teams[pk] for pk in sorted(allowed.roles) if pk in config.teams][:2]
    if len(mine) == 1:
        return mine[0]
    if not mine:
        raise shapes.OpenAIError(
            400,
            "You belong to no team; name one with the X-Telemachus-Team header.",
            code="team_required",
            param=TEAM_HEADER,
        )
    raise shapes.OpenAIError(
        400,
        "You belong to several teams; name one with the X-Telemachus-Team header.",
        code="team_required",
        param=TEAM_HEADER,
    )


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
) -> tuple[Caller, Job, shapes.ModelCall]:
    """Authenticate, translate and check the body, submit: one trip to the database threads.
    `wake` False: the workers are not woken, since the call is claimed in this process next."""
    caller = caller_for(authorization=authorization, team=team, confirm=False, address=address)
    session = _session(session)
    data = shapes.parse_body(body)
    call = dialect.translate(data)
    requirements = {"model": call.model, "est_tokens": call.est_tokens}
    if call.api == EMBEDDINGS_API:
        requirements["api"] = EMBEDDINGS_API
    job = job_submit(
        user=caller.user,
        team=caller.team.slug,
        type=Job.Type.CHAT,
        requirements=requirements,
        input=call.input,
        priority=_priority(priority),
        meta={"via": dialect.via},
        features=(OPENAI,),
        key=caller.key,
        wake=wake,
        affinity_key=session,
    )
    return caller, job, call


def _session(header: str | None) -> str:
    """X-Telemachus-Session: any printable name the app gives a conversation, up to 200 characters."""
    value = (header or "").strip()
    if len(value) > SESSION_MAX_LENGTH or not value.isprintable():
        raise shapes.bad_request(
            f"X-Telemachus-Session must be printable and at most {SESSION_MAX_LENGTH} characters.", SESSION_HEADER
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
        raise shapes.bad_request(
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

    def failure(self) -> GatewayError:
        return shapes.failure(
            status=self.status, error=self.error, upstream_status=self.upstream_status, timed_out=self.timed_out
        )


def _ending(*, job_id: int) -> Ending | None:
    """The job's end, or None while it has not ended."""
    row = Job.objects.filter(pk=job_id).values("status", "result", "error", "cost").first()
    if row is None or row["status"] not in Job.TERMINAL:
        return None
    if row["status"] != Job.Status.FAILED:
        return Ending(status=row["status"], result=row["result"], error=row["error"], cost=row["cost"])
    meta = (
        JobEvent.objects.filter(job_id=job_id, event=JobEvent.Type.FAILED)
        .order_by("-id")
        .values_list("meta", flat=True)
        .first()
    ) or {}
    status = meta.get("status")
    return Ending(
        status=row["status"],
        result=None,
        error=row["error"],
        upstream_status=status if isinstance(status, int) else None,
        timed_out=bool(meta.get("timed_out")),
    )


def _cancel(*, job_id: int, user: rbac.Principal, reason: str) -> Ending | None:
    """Cancel a job its caller no longer waits for, saying why; if it ended first, how it ended."""
    try:
        job_cancel(job_id=job_id, by=user, reason=reason)
    except errors.Conflict:
        return _ending(job_id=job_id)
    return None


async def _next_ending(watch: Watch, flight: onehop.Flight | None) -> tuple[Ending | None, list[Delta]]:
    """What the watch has: output, and the job's end if a change may have ended it (from the
    flight's own finish when this process ran the job and it was answered, with no read). While
    this process is writing the flight's finish, the job ends through it: a notification of that
    end heard first is not read, since the flight's end wakes the watch again."""
    _, maybe_ended, deltas = watch.take()
    if flight is not None and flight.answered:
        return Ending(status=Job.Status.DONE, result=flight.result, error="", cost=flight.cost or ZERO), deltas
    if flight is not None and flight.finishing and not flight.settled:
        return None, deltas
    ending = await db(_ending, job_id=watch.job_id) if maybe_ended else None
    return ending, deltas


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
    return shapes.OpenAIError(
        504,
        f"No answer within {settings.TELEMACHUS_GATEWAY_TIMEOUT_SECONDS:g} s; the job was canceled.",
        type="api_error",
        code="timeout",
        retry=False,
    )


INTERRUPTED = shapes.OpenAIError(
    502,
    "The model's stream broke off after part of the answer was sent, and the job was retried; "
    "its answer can no longer be relayed in order.",
    type="api_error",
    code="stream_interrupted",
    retry=False,
)


# --- the call ------------------------------------------------------------------------------------


async def model_call(request: Request, reply: Reply, *, dialect: Dialect) -> None:
    """Serve one model call in `dialect`: submit its job, wait for it, answer (see the module
    docstring). Errors before the answer starts are raised (GatewayError, DomainError) for the
    protocol's `serve` to render; a stream that has started ends with the dialect's failure event."""
    feed = JobFeed.current()
    mark = feed.mark()
    created = shapes.now()
    hop = onehop.enabled()
    caller, job, call = await db(
        _submit,
        authorization=dialect.authorization(request),
        team=request.header(TEAM_HEADER),
        priority=request.header(PRIORITY_HEADER),
        session=request.header(SESSION_HEADER),
        body=request.body,
        dialect=dialect,
        address=client_address(request.scope),
        wake=not hop,
    )
    with feed.watch(job.pk, deltas=call.stream, since=mark) as watch:
        own = onehop.OwnCalls.current() if hop else None
        flight = await own.claim(job.pk) if own is not None else None
        try:
            if call.stream:
                writer = dialect.writer(job_id=job.pk, created=created, call=call)
                return await _relay(reply, watch, flight, caller, dialect, writer)
            ending = await _wait(reply, watch, flight, caller, dialect)
        finally:
            if own is not None and flight is not None:
                own.abort(flight, "its call ended")  # a no-op once it has finished
    if ending is None:
        return
    if ending.status != Job.Status.DONE:
        return await respond_error(reply, dialect, ending.failure(), job.pk)
    try:
        body = dialect.answer(job_id=job.pk, created=created, call=call, result=ending.result or {})
    except shapes.OpenAIError as exc:
        return await respond_error(reply, dialect, exc, job.pk)
    await reply.json(
        200,
        body,
        {JOB_HEADER: str(job.pk), COST_HEADER: money_text(ending.cost), CURRENCY_HEADER: settings.TELEMACHUS_CURRENCY},
    )


async def _wait(
    reply: Reply, watch: Watch, flight: onehop.Flight | None, caller: Caller, dialect: Dialect
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
    reply: Reply, watch: Watch, flight: onehop.Flight | None, caller: Caller, dialect: Dialect, writer: StreamWriter
) -> None:
    """A streamed call. The response starts with the first output (or the job's end), so a job that
    fails before answering gets a real status (502, 504) instead of an error inside a 200 stream."""
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
    await reply.start(200, {**SSE_HEADERS, JOB_HEADER: str(job_id)})
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
    except shapes.OpenAIError as exc:
        return await reply.end(writer.failure(exc))
    await reply.end(closing)
