"""A flow's round and a tool job, as a worker runs them (scheduler/worker/dispatch.py hands them here).

One claim of a flow is one round:

    claim (round_started) ──> model call (the slot held) ──> round_finish: slot freed, round billed
                          ──> the tool calls, in the worker's tool threads (no slot held, no
                              transaction open, the lease still heartbeated) ──> round_requeue:
                              results recorded, the flow back in the queue for its next round,
                              as new work

so a flow waiting for its next round holds no slot and no worker capacity, and other jobs take the
slot between rounds. The claim starts the round itself (`round_claimed`); `round_begin` runs only
when the last round's tool calls have no results yet (their worker stopped).

The tool calls start as soon as the model has answered. When they are all done within
TELEMACHUS_FLOW_QUICK_TOOLS_MS (an echo, a lookup), the round's end and the next round's queueing
are written together (rounds_end, which the worker batches with other rounds that end meanwhile,
`host.round_end`): one write instead of two, the slot held those few milliseconds longer.

A flow submitted with `"stream": true` streams each round's model call: its text and tool-call
pieces go to the job's stream (`GET /api/jobs/{id}/stream/`) as the model writes them, tagged with
the round and the round's attempt (a flow's attempts count per round), and they have left before the
round's end is written, so a relay sees them before `round_finished`.

A failed model call ends like any job's attempt (the worker's finisher: jobs_finish, retried with
backoff, or failed); either way the dispatch reaches the executor's breaker through the worker's
one path (`dispatches_report`, or the finisher's). A cancel aborts the model call upstream or
abandons the tools, and the fenced writes that follow are refused. The services
(scheduler/services/rounds.py) say what a crash at each point leaves behind.
"""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from functools import partial
from typing import Any, Protocol, TypeVar

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from executors.contract import DispatchError
from executors.health import DispatchReport
from executors.tools import ToolOutcome, UnknownTool, tool_invoke
from scheduler.core.configuration import configuration
from scheduler.core.jobtypes import job_request
from scheduler.metrics import dispatch_observe
from scheduler.models import Job
from scheduler.notify.broadcast import DeltaStream
from scheduler.services.claim import Claim
from scheduler.services.finish import Outcome
from scheduler.services.rounds import (
    DEFAULT_MAX_ROUNDS,
    LeaseLost,
    RoundOutcome,
    round_begin,
    round_claimed,
    round_finish,
    round_requeue,
    round_tool_record,
)
from scheduler.worker.flight import Flight
from scheduler.worker.traces import model_call_traced, tool_traced
from telemachus import tracing
from telemachus.control.config import config_current
from telemachus.control.features import feature_on

log = logging.getLogger("telemachus.worker")
T = TypeVar("T")


class RoundHost(Protocol):
    """What a round needs from the worker that claimed it."""

    tool_threads: Executor

    async def db_retrying(self, fn: Callable[..., T], /, **kwargs: Any) -> T: ...

    async def dispatches_report(self, dispatches: list[DispatchReport]) -> None: ...

    def flight_ended(self, job_id: int, *, queued: bool = False) -> None: ...

    async def round_end(self, end: RoundOutcome) -> str:
        """`rounds_end` for this round (batched), the answered dispatch reported to the breaker."""
        ...


async def flow_round_run(host: RoundHost, flight: Flight) -> None:
    """Run the claimed round of a flow to its end (the flow done or failed, or queued for its next
    round). Raises what the model call raises (DispatchError, CancelledError), for the worker to
    end the job as any other; handles everything after the call itself, and ends the flight."""
    queued = False
    try:
        queued = await _round(host, flight)
    except LeaseLost as exc:
        log.warning("job %d: %s; dropped", flight.claim.job.pk, exc.detail)
    host.flight_ended(flight.claim.job.pk, queued=queued)


async def _round(host: RoundHost, flight: Flight) -> bool:
    """The round; True when it queued the flow's next round without waking the other workers
    (the host claims it with the capacity the round freed)."""
    claim = flight.claim
    job = claim.job
    assert claim.executor is not None and flight.driver is not None, "a flow's round runs on an executor"
    start = round_claimed(job)
    if start is None:
        start = await host.db_retrying(round_begin, job_id=job.pk, lease=claim.lease)
    if tracing.active:
        tracing.current_span().set_attribute("telemachus.flow.round", start.round)
    if start.pending:
        log.info("job %d: running the tool calls of round %d (their worker stopped)", job.pk, start.round)
        await _requeue_after(host, claim, start.round, _tools_start(host, job, start.pending))
        return False
    try:
        request = job_request(job, messages=start.messages)
    except (UnknownTool, ImproperlyConfigured) as exc:
        raise DispatchError(f"flow tools unavailable: {exc}", retryable=False, executor_fault=False) from exc
    on_delta = DeltaStream(job.pk, attempt=job.attempts, round=start.round) if job.input.get("stream") else None
    began = time.monotonic()
    call = flight.driver.execute(request, on_delta)
    result = await (model_call_traced(job, claim.executor, call) if tracing.active else call)
    if on_delta is not None:
        await on_delta.flush()  # the round's output goes out before its end is announced
    dispatch_observe(executor=claim.executor, outcome="ok", seconds=time.monotonic() - began)
    message = result.output.get("message") or {"role": "assistant", "content": ""}
    calls = list(message.get("tool_calls") or [])
    # The tools start at once (not in a round past max_rounds, which ends the flow).
    running = _tools_start(host, job, calls) if calls and start.round < _max_rounds(job) else []
    try:
        quick = bool(running) and await _quick(running)
        ended: dict[str, Any] = dict(
            job_id=job.pk,
            lease=claim.lease,
            round=start.round,
            message=message,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            # `attempt`: which of the round's attempts answered (the job stream completes that one).
            meta={"seconds": round(time.monotonic() - began, 4), "attempt": job.attempts},
        )
        if quick:
            # The tools are done already: the round's end and the next round's queueing in one
            # transaction (the slot was held the few milliseconds they took).
            status = await host.round_end(RoundOutcome(**ended, results=[task.result() for task in running]))
        else:
            end = await host.db_retrying(round_finish, **ended)
    except BaseException:
        for task in running:
            task.cancel()
        raise
    if quick:
        log.info("job %d round %d: %d quick tool call(s), flow %s", job.pk, start.round, len(calls), status)
        return status == Job.Status.QUEUED
    # After the round's own transaction: job rows and executor rows are never locked together.
    await host.dispatches_report([DispatchReport(executor_id=claim.executor.pk, ok=True, executor_fault=False)])
    if not end.tools_to_run:
        log.info("job %d round %d: flow %s (%d tokens)", job.pk, start.round, end.status, result.tokens_used)
    else:
        await _requeue_after(host, claim, start.round, running or _tools_start(host, job, end.tool_calls))
    return False


async def _requeue_after(
    host: RoundHost, claim: Claim, round_no: int, running: "list[asyncio.Task[ToolOutcome]]"
) -> None:
    """Wait for the round's tool calls (run with no slot held), recording each result as its tool
    ends (so a worker that dies meanwhile leaves those done), then queue the flow's next round."""
    for finished in asyncio.as_completed(running):
        await host.db_retrying(
            round_tool_record, job_id=claim.job.pk, lease=claim.lease, round=round_no, result=await finished
        )
    results = [task.result() for task in running]
    status = await host.db_retrying(
        round_requeue, job_id=claim.job.pk, lease=claim.lease, round=round_no, results=results
    )
    log.info("job %d round %d: %d tool call(s), flow %s", claim.job.pk, round_no, len(results), status)


def _max_rounds(job: Job) -> int:
    return int(job.input.get("max_rounds") or DEFAULT_MAX_ROUNDS)


def _tools_start(host: RoundHost, job: Job, calls: list[dict[str, Any]]) -> "list[asyncio.Task[ToolOutcome]]":
    """The round's tool calls, started in the worker's tool threads, in call order. While the
    `tool` feature is switched off for the flow's team (the switches as this process last read
    them: the claim of this round confirmed their version), none runs: each fails, saying so, and
    the flow fails with it (or, with `return_tool_errors`, the model is told)."""
    switches = configuration(config_current()[0]).features
    if not feature_on(feature=Job.Type.TOOL, team_id=job.team_id, switches=switches):
        return [asyncio.ensure_future(_switched_off(call)) for call in calls]
    allowed = set(job.input.get("tools") or ())
    return [asyncio.ensure_future(_tool_start(host, job, call, allowed)) for call in calls]


def _tool_start(host: RoundHost, job: Job, call: dict[str, Any], allowed: set[str]) -> Awaitable[ToolOutcome]:
    """One tool call of the round (in its `execute_tool` span when the flow is traced)."""
    name, call_id = str((call.get("function") or {}).get("name", "")), str(call.get("id", ""))
    invoke = partial(
        tool_invoke,
        name=name,
        arguments=(call.get("function") or {}).get("arguments", "{}"),
        call_id=call_id,
        threads=host.tool_threads,
        allowed=allowed,
    )
    return tool_traced(job, name, call_id, invoke) if tracing.active else invoke()


async def _switched_off(call: dict[str, Any]) -> ToolOutcome:
    name = str((call.get("function") or {}).get("name", ""))
    message = f"tool {name!r} was not run: the tool feature is switched off for this team"
    return ToolOutcome(name=name, call_id=str(call.get("id", "")), ok=False, content=message, seconds=0.0)


async def _quick(running: "list[asyncio.Task[ToolOutcome]]") -> bool:
    """Whether the round's tools end within TELEMACHUS_FLOW_QUICK_TOOLS_MS of the model's answer:
    then the round's end waits for them and is written with their results, in one transaction
    (rounds_end), for the price of holding the slot that long at most. Slower tools go on running
    after the round's end frees the slot."""
    quick = settings.TELEMACHUS_FLOW_QUICK_TOOLS_MS / 1000
    if quick <= 0:
        return False
    _, pending = await asyncio.wait(running, timeout=quick)
    return not pending


async def tool_job_outcome(host: RoundHost, claim: Claim) -> Outcome:
    """Run a tool job's tool; its result is `{"value", "tool", "elapsed_s"}` (the value is what the
    tool returned), as a task job's is; its failure is the tool's error."""
    job = claim.job
    outcome: ToolOutcome = await tool_invoke(
        name=job.input.get("tool", ""), arguments=job.input.get("arguments", {}), threads=host.tool_threads
    )
    if not outcome.ok:
        return Outcome(
            job_id=job.pk,
            lease=claim.lease,
            ok=False,
            error=outcome.content,
            meta={"seconds": round(outcome.seconds, 4)},
        )
    return Outcome(
        job_id=job.pk,
        lease=claim.lease,
        ok=True,
        tokens_used=0,
        meta={"seconds": round(outcome.seconds, 4)},
        result={"value": json.loads(outcome.content), "tool": outcome.name, "elapsed_s": round(outcome.seconds, 4)},
    )
