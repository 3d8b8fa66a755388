"""The OpenAI-compatible endpoint, governed: `POST /v1/chat/completions` (plain and `stream: true`),
`POST /v1/embeddings`, `GET /v1/models` and `GET /v1/models/{model}`.

Each call is a `chat` job submitted through `job_submit` (RBAC, budgets, priority map, depth cap),
so it is queued, ordered by fair share and placed under every cap like any other job; the request
then waits for it on the process's job feed, holding no thread and no database connection, and
answers with the model's reply in OpenAI's shape. A streamed call relays the model's deltas as the
worker receives them. A client that disconnects, or a call that waits longer than
TELEMACHUS_GATEWAY_TIMEOUT_SECONDS (504), cancels its job, which frees its slot at once.

The caller is an app's API key or a person's token (`Authorization: Bearer KEY`,
telemachus/keys/). A key acts for its team, and may call only its models (404 model_not_found,
as for a model its team has no executor for); for a person the team is the one the
`X-Telemachus-Team` header names, or the caller's only team. `X-Telemachus-Priority` asks for a
priority (the priority map may lower it). Every response about a job names it in
`X-Telemachus-Job`; a plain (not streamed) answer also carries what the call cost in
`X-Telemachus-Cost` (a decimal string, in `X-Telemachus-Currency`)."""

import asyncio
import json
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings

from executors.contract import EMBEDDINGS_API
from executors.selectors import models_usable_by
from quotas.models import ZERO, money_text
from scheduler.core.configuration import configuration
from scheduler.gateway import shapes
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.auth import TooManyFailures, client_address, credential_for
from scheduler.gateway.database import db
from scheduler.gateway.feed import Delta, JobFeed, Relay, Watch
from scheduler.models import Job, JobEvent
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from telemachus import errors
from telemachus.control.config import config_current, config_snapshot
from telemachus.control.features import OPENAI, feature_require
from telemachus.models import ApiKey, Team
from telemachus.teams import rbac

log = logging.getLogger("telemachus.gateway")
TEAM_HEADER, PRIORITY_HEADER, JOB_HEADER = "x-telemachus-team", "x-telemachus-priority", "x-telemachus-job"
COST_HEADER, CURRENCY_HEADER = "x-telemachus-cost", "x-telemachus-currency"
KEEPALIVE_SECONDS = 15.0
SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache", "x-accel-buffering": "no"}


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return shapes.OpenAIError(status, message, code=code).body()


async def serve(request: Request, reply: Reply, rest: str) -> None:
    """Route a /v1/ request; every error leaves in OpenAI's shape."""
    routes = {
        "chat/completions": ("POST", chat_completions),
        "embeddings": ("POST", embeddings),
        "models": ("GET", models),
    }
    path = rest.rstrip("/")
    if path.startswith("models/") and path != "models/":
        method, handler, kwargs = "GET", model_detail, {"model": path.removeprefix("models/")}
    elif path in routes:
        (method, handler), kwargs = routes[path], {}  # type: ignore[assignment]
    else:
        return await _error(
            reply,
            shapes.OpenAIError(404, f"Unknown path: {request.method} {request.path}", code="unknown_url", retry=False),
        )
    if request.method != method:
        return await _error(
            reply,
            shapes.OpenAIError(
                405,
                f"{request.method} is not allowed on {request.path}; use {method}.",
                code="method_not_allowed",
                retry=False,
            ),
        )
    try:
        await handler(request, reply, **kwargs)
    except (shapes.OpenAIError, errors.DomainError) as exc:
        failure = exc if isinstance(exc, shapes.OpenAIError) else shapes.from_domain(exc)
        if not reply.started:
            await _error(reply, failure)
        elif not reply.finished:  # a stream under way: the error is its last event
            await reply.end(b"data: " + json.dumps(failure.body()).encode() + b"\n\n")


async def _error(reply: Reply, exc: shapes.OpenAIError, job_id: int | None = None) -> None:
    headers = {**exc.headers, **({JOB_HEADER: str(job_id)} if job_id else {})}
    await reply.json(exc.status, exc.body(), headers)


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
    every /v1/ call passes once its caller and team are known. The switches are the cached ones;
    with `confirm` False, those this process last used, unconfirmed (no query), for a submit,
    which confirms its configuration and checks the switch again. A refusal is believed only
    from a confirmed read. Too many bad credentials from `address`: 429 with Retry-After."""
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
    caller = Caller(user=user, team=team_of(user, team), key=credential.key)
    snapshot, fresh = (config_snapshot(), True) if confirm else config_current()
    try:
        feature_require(feature=OPENAI, team=caller.team, switches=configuration(snapshot).features)
    except errors.FeatureDisabled:
        if fresh:
            raise
        feature_require(feature=OPENAI, team=caller.team, switches=configuration(config_snapshot()).features)
    return caller


def team_of(user: rbac.Principal, slug: str | None) -> Team:
    """The team named, if the caller may act in it (it reads as not found otherwise, as other
    teams' objects do), else the caller's only team."""
    if slug:
        named = rbac.visible_teams(user).filter(slug=slug).first()
        if named is None:
            raise shapes.OpenAIError(
                404, f"No team {slug!r} that you belong to.", code="team_not_found", param=TEAM_HEADER, retry=False
            )
        return named
    mine = list(rbac.member_teams(user)[:2])
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
    embeddings: bool,
    address: str,
) -> tuple[Caller, Job, shapes.ModelCall]:
    """Authenticate, check the body, submit: one trip to the database threads."""
    caller = caller_for(authorization=authorization, team=team, confirm=False, address=address)
    data = shapes.parse_body(body)
    call = shapes.embeddings_call(data) if embeddings else shapes.chat_call(data)
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
        meta={"via": "openai"},
        features=(OPENAI,),
        key=caller.key,
    )
    return caller, job, call


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

    def failure(self) -> shapes.OpenAIError:
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


async def _next_ending(watch: Watch) -> tuple[Ending | None, list[Delta]]:
    """What the watch has: output, and the job's end if a change may have ended it."""
    _, maybe_ended, deltas = watch.take()
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


def _timeout() -> shapes.OpenAIError:
    return shapes.OpenAIError(
        504,
        f"No answer within {settings.TELEMACHUS_GATEWAY_TIMEOUT_SECONDS:g} s; the job was canceled.",
        type="api_error",
        code="timeout",
        retry=False,
    )


# --- endpoints -----------------------------------------------------------------------------------


async def chat_completions(request: Request, reply: Reply) -> None:
    await _model_call(request, reply, embeddings=False)


async def embeddings(request: Request, reply: Reply) -> None:
    await _model_call(request, reply, embeddings=True)


async def _model_call(request: Request, reply: Reply, *, embeddings: bool) -> None:
    feed = JobFeed.current()
    mark = feed.mark()
    created = shapes.now()
    caller, job, call = await db(
        _submit,
        authorization=request.header("authorization"),
        team=request.header(TEAM_HEADER),
        priority=request.header(PRIORITY_HEADER),
        body=request.body,
        embeddings=embeddings,
        address=client_address(request.scope),
    )
    with feed.watch(job.pk, deltas=call.stream, since=mark) as watch:
        if call.stream:
            await _relay(reply, watch, caller, call, created)
            return
        deadline = _deadline()
        while True:
            ending, _ = await _next_ending(watch)
            if ending is not None:
                break
            if not await watch.wait(_left(deadline), unless=reply.gone):
                ending = await db(_cancel, job_id=job.pk, user=caller.user, reason=_why(reply))
                if reply.gone.done():
                    log.info("job %d: client left; canceled", job.pk)
                    return
                if ending is None:
                    return await _error(reply, _timeout(), job.pk)
                break
    if ending.status != Job.Status.DONE:
        return await _error(reply, ending.failure(), job.pk)
    result = ending.result or {}
    body = (
        shapes.embeddings(model=call.model, result=result)
        if embeddings
        else shapes.completion(job_id=job.pk, created=created, model=call.model, result=result)
    )
    await reply.json(
        200,
        body,
        {
            JOB_HEADER: str(job.pk),
            COST_HEADER: money_text(ending.cost),
            CURRENCY_HEADER: settings.TELEMACHUS_CURRENCY,
        },
    )


INTERRUPTED = shapes.OpenAIError(
    502,
    "The model's stream broke off after part of the answer was sent, and the job was retried; "
    "its answer can no longer be relayed in order.",
    type="api_error",
    code="stream_interrupted",
    retry=False,
)


async def _relay(reply: Reply, watch: Watch, caller: Caller, call: shapes.ModelCall, created: int) -> None:
    """A streamed call. The response starts with the first output (or the job's end), so a job that
    fails before answering gets a real status (502, 504) instead of an error inside a 200 stream."""
    job_id, deadline, relay = watch.job_id, _deadline(), Relay(exact=True)

    def sse(data: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return sse(
            shapes.chunk(job_id=job_id, created=created, model=call.model, delta=delta, finish_reason=finish, **extra)
        )

    while True:
        ending, deltas = await _next_ending(watch)
        text = "".join(piece.text for piece in relay.accept(deltas))
        if text or ending is not None:
            break
        if not await watch.wait(_left(deadline), unless=reply.gone):
            ending = await db(_cancel, job_id=job_id, user=caller.user, reason=_why(reply))
            if reply.gone.done():
                return
            if ending is None:
                return await _error(reply, _timeout(), job_id)
            break
    if not text and ending is not None and ending.status != Job.Status.DONE:
        return await _error(reply, ending.failure(), job_id)
    await reply.start(200, {**SSE_HEADERS, JOB_HEADER: str(job_id)})
    await reply.write(chunk({"role": "assistant", "content": text}))
    while ending is None:
        if relay.broken:
            await db(
                _cancel,
                job_id=job_id,
                user=caller.user,
                reason="stream interrupted: the model's stream broke off after part of the answer was relayed",
            )
            return await reply.end(sse(INTERRUPTED.body()))
        if not await watch.wait(min(_left(deadline), KEEPALIVE_SECONDS), unless=reply.gone):
            if reply.gone.done():
                await db(_cancel, job_id=job_id, user=caller.user, reason=LEFT)
                log.info("job %d: client left its stream; canceled", job_id)
                return
            if _left(deadline) <= 0:
                ending = await db(_cancel, job_id=job_id, user=caller.user, reason=_waited_too_long())
                if ending is None:
                    return await reply.end(sse(_timeout().body()))
                break
            await reply.write(b": keepalive\n\n")
            continue
        ending, deltas = await _next_ending(watch)
        text = "".join(piece.text for piece in relay.accept(deltas))
        if text:
            await reply.write(chunk({"content": text}))
    if ending.status != Job.Status.DONE:
        return await reply.end(sse(ending.failure().body()))
    result = ending.result or {}
    rest = relay.rest(result)
    if rest is None or relay.broken:
        return await reply.end(sse(INTERRUPTED.body()))
    if rest:
        await reply.write(chunk({"content": rest}))
    calls = (result.get("message") or {}).get("tool_calls")
    if calls:
        await reply.write(chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
    await reply.write(chunk({}, result.get("finish_reason") or "stop"))
    if call.include_usage:
        await reply.write(
            sse(
                shapes.chunk(
                    job_id=job_id,
                    created=created,
                    model=call.model,
                    delta={},
                    choices=False,
                    usage=shapes.usage(result),
                )
            )
        )
    await reply.end(b"data: [DONE]\n\n")


async def models(request: Request, reply: Reply) -> None:
    offered = await db(
        _models,
        authorization=request.header("authorization"),
        team=request.header(TEAM_HEADER),
        address=client_address(request.scope),
    )
    await reply.json(200, shapes.model_list(offered))


async def model_detail(request: Request, reply: Reply, model: str) -> None:
    offered = await db(
        _models,
        authorization=request.header("authorization"),
        team=request.header(TEAM_HEADER),
        address=client_address(request.scope),
    )
    if model not in offered:
        raise shapes.OpenAIError(
            404,
            f"The model {model!r} does not exist or your team may not use it.",
            code="model_not_found",
            param="model",
            retry=False,
        )
    await reply.json(200, shapes.model_object(model))


def _models(*, authorization: str | None, team: str | None, address: str) -> list[str]:
    """The models of the enabled executors the caller's team may use that answer model calls (and
    that its key, if it came with one, may call)."""
    caller = caller_for(authorization=authorization, team=team, confirm=True, address=address)
    return sorted(m for m in models_usable_by([caller.team.pk], chat=True)[caller.team.pk] if caller.may_call(m))
