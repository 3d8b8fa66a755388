"""A claimed job's dispatch, from its claim to the `Outcome` its finish writes.

One model call (`model_call_outcome`) is shared by the worker and by an API process that runs the
call it holds (scheduler/gateway/onehop.py), so the two cannot differ in what they send the
executor or in what they store. A worker's flight (`flight_dispatch`) may also be a flow's round
(scheduler/flows/runner.py: it writes its own end) or a tool job, run in the worker's tool threads;
a governed slot is its app's to run (scheduler/flows/governed.py) and never gets here."""

import logging
import time
from functools import partial
from typing import Any, Protocol

from executors.contract import DeltaSink, DispatchError, ExecutorDriver, StepSink
from scheduler.core.jobtypes import job_output, job_request
from scheduler.flows.runner import RoundHost, flow_round_run, tool_job_outcome
from scheduler.metrics import dispatch_observe
from scheduler.models import Job
from scheduler.notify.broadcast import DeltaStream
from scheduler.services.claim import Claim
from scheduler.services.finish import Outcome
from scheduler.worker.flight import Flight
from scheduler.worker.traces import model_call_traced
from telemachus import tracing

log = logging.getLogger("telemachus.worker")


class DispatchHost(RoundHost, Protocol):
    """What a worker's flight needs from the worker: a round's needs, and where steps go."""

    async def step_record(self, flight: Flight, meta: dict[str, Any]) -> None: ...


async def flight_dispatch(host: DispatchHost, flight: Flight) -> Outcome | None:
    """Run a worker's flight to its outcome (None: a flow's round, which writes its own end). A
    failure fails the job, never the worker; cancellation (an abort) propagates. A streamed job's
    output has gone out before the outcome is returned (the finish announces its end)."""
    job = flight.claim.job
    started = time.perf_counter()
    on_delta: DeltaStream | None = None
    try:
        if job.type == Job.Type.FLOW:
            await flow_round_run(host, flight)  # writes its own end
            return None
        if job.type == Job.Type.TOOL:
            outcome = await tool_job_outcome(host, flight.claim)
        else:
            on_delta = DeltaStream(job.pk, attempt=job.attempts) if job.input.get("stream") else None
            assert flight.driver is not None  # only tool jobs run without an executor
            outcome, flight.executor_fault = await model_call_outcome(
                driver=flight.driver,
                claim=flight.claim,
                on_delta=on_delta,
                on_step=partial(host.step_record, flight),
                started=flight.started,
            )
    except DispatchError as exc:
        dispatch_observe(executor=flight.claim.executor, outcome="error", seconds=time.perf_counter() - started)
        flight.executor_fault = exc.executor_fault
        outcome = failure_outcome(flight.claim, exc)
    except Exception as exc:  # a bug must fail the job, not kill the worker
        log.exception("job %d: %s raised", job.pk, f"driver {flight.driver.kind}" if flight.driver else "its run")
        outcome = Outcome(job_id=job.pk, lease=flight.claim.lease, ok=False, error=f"driver error: {exc!r}")
    if on_delta is not None:
        await on_delta.flush()  # the output goes out before the end that the finish announces
    return outcome


async def model_call_outcome(
    *,
    driver: ExecutorDriver,
    claim: Claim,
    on_delta: DeltaSink | None,
    started: float,
    on_step: StepSink | None = None,
) -> tuple[Outcome, bool]:
    """Run the claimed job's model call (chat, translate, embeddings) on `driver`, outside any
    transaction, and return its outcome and whether a failure is the executor's fault (for its
    breaker). A driver that raises anything fails the job, never its caller. Cancellation (an
    abort) propagates. `started` is when the flight started (time.monotonic); `on_step` receives
    what the driver reports during the dispatch (a `step` event's meta)."""
    job = claim.job
    began = time.perf_counter()
    try:
        call = driver.execute(job_request(job), on_delta, on_step)
        result = await (model_call_traced(job, claim.executor, call) if tracing.active else call)
    except DispatchError as exc:
        dispatch_observe(executor=claim.executor, outcome="error", seconds=time.perf_counter() - began)
        return failure_outcome(claim, exc), exc.executor_fault
    except Exception as exc:  # a driver bug must fail the job, not its caller
        log.exception("job %d: driver %s raised", job.pk, driver.kind)
        return Outcome(job_id=job.pk, lease=claim.lease, ok=False, error=f"driver error: {exc!r}"), False
    dispatch_observe(executor=claim.executor, outcome="ok", seconds=time.perf_counter() - began)
    return (
        Outcome(
            job_id=job.pk,
            lease=claim.lease,
            ok=True,
            result=job_output(job, result.stored_output()),
            tokens_used=result.tokens_used,
            meta={
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "seconds": round(time.monotonic() - started, 4),
            },
        ),
        False,
    )


def failure_outcome(claim: Claim, exc: DispatchError) -> Outcome:
    """A failed dispatch as its finish stores it: retried or failed per the error."""
    return Outcome(
        job_id=claim.job.pk,
        lease=claim.lease,
        ok=False,
        error=str(exc),
        result=exc.detail,
        retryable=exc.retryable,
        retry_after=exc.retry_after,
        meta={"status": exc.status, **({"timed_out": True} if exc.timed_out else {})},
    )
