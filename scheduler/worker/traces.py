"""The spans of a job's work in the process that claimed it: a worker, or an API process running
the call it holds (one hop). Both claim through `job_claim` and run through the flight host
(scheduler/worker/host.py), so their spans are the same (docs/tracing.md):

  job.queue_wait   from when the job (or a flow's round) entered the queue to its claim
  job.claim        the claim that took it, and where it was placed: the executor, and the caps
                   that bound the placement (the executor's slots, the global, team and user caps)
  job.run          its dispatch (a flow's round: `flow.round`), until its outcome is known
    chat <model>   the model call (kind CLIENT), in OpenTelemetry's GenAI semantic conventions
    execute_tool   each tool a flow's round runs

Each is a child of the span that submitted the job (its `job.submit`, whose context the job keeps
in `meta.trace`), so they join the caller's trace in whatever process they run. A job that kept
no context (submitted by a process that did not trace) is not traced here either: the submitting
process decides, as OpenTelemetry's parent-based sampling does.

Callers test `tracing.active` first: while tracing is off nothing here runs."""

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from executors.contract import EMBEDDINGS_API, DispatchResult
from executors.models import Executor
from quotas.concurrency import executor_limit
from scheduler.core.configuration import Configuration, configuration
from scheduler.core.jobtypes import MODEL_CALL_TYPES
from scheduler.models import Job
from scheduler.services.claim import Claim
from telemachus import tracing
from telemachus.control.config import config_current

if TYPE_CHECKING:
    from opentelemetry.context import Context

T = TypeVar("T")
# Executor kinds that speak the OpenAI-compatible API: their model calls' gen_ai.provider.name.
OPENAI_KINDS = frozenset({"local-model", "remote-model"})


def job_context(job: Job) -> "Context | None":
    """The context of the span that submitted the job; None when it kept none (or tracing is off)."""
    return tracing.context_from_carrier(job.meta.get(tracing.TRACE_META_KEY))


def job_attributes(job: Job, conf: Configuration | None = None) -> dict[str, Any]:
    """What names a job on each of its spans: id, type, team (its slug), attempt, model."""
    conf = conf or configuration(config_current()[0])
    team = conf.teams.get(job.team_id)
    attributes: dict[str, Any] = {
        "telemachus.job.id": job.pk,
        "telemachus.job.type": job.type,
        "telemachus.job.attempt": job.attempts,
        "telemachus.team": team.slug if team is not None else str(job.team_id),
    }
    if job.model:
        attributes["gen_ai.request.model"] = job.model
    return attributes


def claims_traced(claims: list[Claim], *, worker: str, began_ns: int, ended_ns: int) -> None:
    """`job.queue_wait` and `job.claim` of each job of a claim that ran from `began_ns` to
    `ended_ns` (time.time_ns()). The queue wait starts at the job's `queued_at` (the submit, or
    its flow's latest round), written by the clock of the process that queued it."""
    conf = configuration(config_current()[0])
    for claim in claims:
        job = claim.job
        parent = job_context(job)
        if parent is None:
            continue
        attributes = job_attributes(job, conf)
        queued_ns = int(job.queued_at.timestamp() * 1e9)
        tracing.span_between(
            "job.queue_wait", parent=parent, start_ns=queued_ns, end_ns=began_ns, attributes=attributes
        )
        placement = {**attributes, "telemachus.worker": worker, **_placement(claim, job, conf)}
        tracing.span_between("job.claim", parent=parent, start_ns=began_ns, end_ns=ended_ns, attributes=placement)


def _placement(claim: Claim, job: Job, conf: Configuration) -> dict[str, Any]:
    """Where the claim placed the job, and the slot caps that bound it there (a scope without a
    cap is left out)."""
    caps = conf.caps
    placed: dict[str, Any] = {}
    executor = claim.executor
    if executor is not None:
        placed["telemachus.executor"] = executor.name
        placed["telemachus.executor.id"] = executor.pk
        placed["telemachus.executor.kind"] = executor.kind
        placed["telemachus.cap.executor"] = executor_limit(
            name=executor.name, max_concurrency=executor.max_concurrency, caps=caps
        )
    if caps.global_cap is not None:
        placed["telemachus.cap.global"] = caps.global_cap
    if (team_cap := caps.team.get(job.team_id)) is not None:
        placed["telemachus.cap.team"] = team_cap
    if (user_cap := caps.user.get(job.user_id)) is not None:
        placed["telemachus.cap.user"] = user_cap
    return placed


async def run_traced(job: Job, executor: Executor | None, run: Awaitable[T]) -> T:
    """Await a claimed job's dispatch inside its `job.run` span (a flow's: `flow.round`), so the
    model call and the tools nest under it; the span fails when the outcome is a failure."""
    parent = job_context(job)
    if parent is None:
        return await run
    attributes = job_attributes(job)
    if executor is not None:
        attributes["telemachus.executor"] = executor.name
    name = "flow.round" if job.type == Job.Type.FLOW else "job.run"
    with tracing.span(name, parent=parent, attributes=attributes) as span:
        outcome = await run
        ok = getattr(outcome, "ok", True)
        if not ok:
            tracing.span_failed(span, str(getattr(outcome, "error", ""))[:500])
        return outcome


async def model_call_traced(job: Job, executor: Executor | None, call: Awaitable[DispatchResult]) -> DispatchResult:
    """Await a model call (a driver's `execute`) inside its span: `chat <model>` (or `embeddings
    <model>`), kind CLIENT, with OpenTelemetry's GenAI attributes; a call that raises fails it."""
    with _model_span(job, executor) as span:
        result = await call
        _model_answered(span, result)
        return result


def _model_span(job: Job, executor: Executor | None) -> Any:
    """The model call's span, with the GenAI attributes known before the call (the shared no-op
    one when the job is not traced, or is a task: its `job.run` is all there is to say)."""
    if job.type not in MODEL_CALL_TYPES or tracing.TRACE_META_KEY not in job.meta:
        return tracing.NO_SPAN
    operation = EMBEDDINGS_API if job.requirements.get("api") == EMBEDDINGS_API else "chat"
    kind = executor.kind if executor is not None else ""
    provider = "openai" if kind in OPENAI_KINDS else kind
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.system": provider,
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": job.model,
        "telemachus.job.id": job.pk,
    }
    if executor is not None:
        attributes["telemachus.executor"] = executor.name
    max_tokens = job.input.get("max_tokens")
    if isinstance(max_tokens, int):
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if tracing.content_traced():
        attributes["gen_ai.input.messages"] = json.dumps(job.input.get("messages") or job.input.get("input"))
    return tracing.span(f"{operation} {job.model}", client=True, attributes=attributes)


def _model_answered(span: Any, result: DispatchResult) -> None:
    """The answer's GenAI attributes: the model that answered, the tokens, why it stopped, and
    (TELEMACHUS_TRACE_CONTENT=1 only) the answer itself."""
    if not span.is_recording():
        return
    output = result.output
    attributes: dict[str, Any] = {
        "gen_ai.usage.input_tokens": result.prompt_tokens,
        "gen_ai.usage.output_tokens": result.completion_tokens,
    }
    if isinstance(output.get("model"), str):
        attributes["gen_ai.response.model"] = output["model"]
    if isinstance(output.get("id"), str):
        attributes["gen_ai.response.id"] = output["id"]
    if isinstance(output.get("finish_reason"), str):
        attributes["gen_ai.response.finish_reasons"] = [output["finish_reason"]]
    if tracing.content_traced() and output.get("message") is not None:
        attributes["gen_ai.output.messages"] = json.dumps([output["message"]])
    span.set_attributes(attributes)


def tool_traced(job: Job, name: str, call_id: str, start: Callable[[], Awaitable[T]]) -> Awaitable[T]:
    """A flow's tool call (what `start()` returns) inside its `execute_tool <name>` span, a child
    of the round's span (the call itself when the job is not traced)."""
    if tracing.TRACE_META_KEY not in job.meta:
        return start()
    return _tool_span(job, name, call_id, start)


async def _tool_span(job: Job, name: str, call_id: str, start: Callable[[], Awaitable[T]]) -> T:
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
        "telemachus.job.id": job.pk,
    }
    with tracing.span(f"execute_tool {name}", attributes=attributes) as span:
        outcome = await start()
        if getattr(outcome, "ok", True) is False:
            tracing.span_failed(span, "the tool failed")
        return outcome
