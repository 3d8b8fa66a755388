"""One model call's dispatch, from a claim to the `Outcome` its finish writes: shared by the worker
and by an API process that runs the call it holds (scheduler/gateway/onehop.py), so the two cannot
differ in what they send the executor or in what they store."""

import asyncio
import logging
import time

from executors.contract import DeltaSink, DispatchError, ExecutorDriver, StepSink
from executors.models import Executor
from executors.registry import DriverPool
from scheduler.core.jobtypes import job_output, job_request
from scheduler.metrics import dispatch_observe
from scheduler.services.claim import Claim
from scheduler.services.finish import Outcome

log = logging.getLogger("telemachus.worker")


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
        result = await driver.execute(job_request(job), on_delta, on_step)
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


def pooled_driver(pool: DriverPool, executor: Executor) -> ExecutorDriver:
    """The pool's driver for this version of the executor's row; a driver it replaced (the row was
    edited) is closed once its calls in flight are done. Must run in the event loop."""
    driver, retired = pool.get(executor)
    if retired is not None:
        asyncio.create_task(_close_when_idle(retired))
    return driver


async def _close_when_idle(driver: ExecutorDriver) -> None:
    while driver.busy:
        await asyncio.sleep(1)
    await driver.aclose()
