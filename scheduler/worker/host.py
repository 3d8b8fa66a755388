"""A flight host: the claimed jobs one process runs (its flights), and what keeps them. The same
code in a worker (scheduler/worker/runner.py) and in an API process that runs the calls it holds
(scheduler/gateway/onehop.py, one hop), so the two cannot differ in how a result is written, a
breaker told or a lease kept.

  flights    `fly` starts a claimed job's dispatch as a task (a driver that cannot be built fails
             the job at once); the dispatch's outcome goes to the finisher.
  finisher   writes the outcomes of the dispatches that ended, in batches: one `jobs_finish` for
             all that end while a batch is being written (fewer commits under load; at one job,
             no wait), fenced by each job's lease, so a job completes once. Then the executors'
             breakers hear how the dispatches ended (`breaker_record`), in a transaction of its
             own. A batch with an executor fault holds the breaker gate throughout: no claim of
             this host runs between an executor's failure and its breaker hearing of it (the
             breaker may take the executor out of placement). A result the database refuses (bad
             data, not an outage) is isolated by writing the batch one by one, and its job fails
             with the reason instead of blocking every later result.
  outages    writes that must not be lost are retried until the database answers (`db_retrying`;
             results written after the lease ran out are refused by fencing, which is correct). A
             host may bound its finishes' retries (`finish_patience`): past the lease the finish
             would be refused anyway, and recovery takes the jobs back.
  heartbeat  renews the leases of the flights every `beat_interval()` (a third of the lease); a
             lease not renewed (lost, recovered, the job canceled) aborts its flight, and so does a
             database out of reach for longer than the lease.
  abort      the flight's driver closes its request upstream; anything else it is doing (a flow's
             tools, a tool job, a write) is cancelled outright, and the fenced write that would
             follow is refused anyway. A flight whose dispatch has ended has nothing left to stop.

A host says what differs by overriding: where its writes about held jobs run (`held_db`), whether
its finishes wake other processes (`wake_others`), when its heartbeat runs (`beating`,
`beat_interval`, `beaten`), and what a finished batch or an aborted flight means to it
(`finished`, `aborted`)."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any, Generic, TypeVar

from django.conf import settings
from django.db import DatabaseError

from executors.contract import ExecutorDriver
from executors.health import DispatchReport, breaker_quiet, breaker_record
from executors.models import Executor
from executors.registry import DriverPool
from scheduler.connections import database_outage
from scheduler.services.events import job_step_record
from scheduler.services.finish import FinishReport, Outcome, jobs_finish
from scheduler.services.lease import leases_renew
from scheduler.worker.flight import Flight
from scheduler.worker.traces import run_traced
from telemachus import tracing

F = TypeVar("F", bound=Flight)
T = TypeVar("T")
# The most outcomes one finish writes.
FINISH_BATCH = 256


class FlightHost(Generic[F]):
    log = logging.getLogger("telemachus.worker")

    def __init__(self, *, name: str) -> None:
        self.name = name
        self.lease_seconds = settings.TELEMACHUS_LEASE_SECONDS
        self.flights: dict[int, F] = {}
        self.drivers = DriverPool()
        self.breaker_gate = asyncio.Lock()
        self.finish_patience: float | None = None  # None: finishes are retried until the database answers
        self._ended: list[tuple[F, Outcome]] = []  # outcomes waiting for the finisher
        self._finisher: asyncio.Task[None] | None = None

    # --- what a host says ---------------------------------------------------------------------------

    async def held_db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Run a write about the jobs this host holds (finishes, heartbeats, breaker records)."""
        raise NotImplementedError

    @property
    def wake_others(self) -> bool:
        """Whether a finish wakes the workers for the capacity it frees."""
        return True

    def finished(self, batch: list[tuple[F, Outcome]], report: FinishReport | None) -> None:
        """The batch's finish is written (`report`), or could not be (None: left to recovery)."""

    def aborted(self, flight: F) -> None:
        """The flight's dispatch was cancelled (see `abort`); nothing of it will be finished."""

    def beating(self) -> bool:
        """Whether the heartbeat goes on (it stops when this is False)."""
        return True

    def beat_interval(self) -> float:
        return self.lease_seconds / 3

    def beaten(self) -> None:
        """The heartbeat woke, before it renews the leases."""

    # --- flights ------------------------------------------------------------------------------------

    def fly(self, flight: F, dispatch: Callable[[F], Awaitable[Outcome | None]]) -> F:
        """Start running a claimed job: `dispatch` runs it and returns its outcome, for the finisher
        (None: it wrote its own end, as a flow's round does). Must run in the event loop."""
        flight.renewed_at = flight.started = time.monotonic()
        self.flights[flight.job_id] = flight
        executor = flight.claim.executor
        if executor is not None:
            try:
                flight.driver = pooled_driver(self.drivers, executor)
            except Exception as exc:  # a driver that cannot be built fails its job, never the host
                self.log.error("job %d: no driver for executor %s: %s", flight.job_id, executor.name, exc)
                flight.executor_fault = True
                error = f"executor {executor.name} has no usable driver: {exc}"
                self.finish(flight, Outcome(job_id=flight.job_id, lease=flight.claim.lease, ok=False, error=error))
                return flight
        flight.task = asyncio.create_task(self._run(flight, dispatch), name=f"job-{flight.job_id}")
        return flight

    async def _run(self, flight: F, dispatch: Callable[[F], Awaitable[Outcome | None]]) -> None:
        try:
            if tracing.active:
                outcome = await run_traced(flight.claim.job, flight.claim.executor, dispatch(flight))
            else:
                outcome = await dispatch(flight)
        except asyncio.CancelledError:
            self.log.info("job %d dispatch aborted: %s", flight.job_id, flight.abort_reason or "cancelled")
            self.aborted(flight)
            if flight.abort_reason is None:
                raise
            return
        except Exception as exc:  # a bug must fail the job, not kill the host
            self.log.exception("job %d: its dispatch raised", flight.job_id)
            outcome = Outcome(job_id=flight.job_id, lease=flight.claim.lease, ok=False, error=f"driver error: {exc!r}")
        if outcome is not None:
            self.finish(flight, outcome)

    async def step_record(self, flight: F, meta: dict[str, Any]) -> None:
        """What the driver reported during the dispatch (a batch job's id): a `step` event."""
        claim = flight.claim
        executor_id = claim.executor.pk if claim.executor is not None else None
        await self.held_db(
            job_step_record, job_id=claim.job.pk, executor_id=executor_id, attempt=claim.job.attempts, **meta
        )

    def abort(self, job_id: int, reason: str) -> None:
        """Stop the flight's dispatch, for `reason` (the first given stands): its job was canceled,
        its lease is lost, the host stops. Its lease is no longer renewed."""
        flight = self.flights.get(job_id)
        if flight is None or flight.abort_reason is not None:
            return
        flight.abort_reason = reason
        if not flight.finishing and flight.task is not None and not flight.task.done():
            self.log.info("job %d: aborting dispatch (%s)", job_id, reason)
            asyncio.create_task(_stop(flight))

    # --- finishing ----------------------------------------------------------------------------------

    def finish(self, flight: F, outcome: Outcome) -> None:
        """Hand a dispatch's outcome to the finisher: written with the others that end meanwhile."""
        flight.finishing = True
        self._ended.append((flight, outcome))
        if self._finisher is None or self._finisher.done():
            self._finisher = asyncio.create_task(self._finish_ended(), name="finisher")

    async def _finish_ended(self) -> None:
        """Finish the flights whose dispatch ended, a batch at a time, until none waits."""
        while self._ended:
            if len(self._ended) <= FINISH_BATCH:
                batch, self._ended = self._ended, []
            else:
                batch, self._ended = self._ended[:FINISH_BATCH], self._ended[FINISH_BATCH:]
            reports = [
                DispatchReport(executor_id=f.claim.executor.pk, ok=outcome.ok, executor_fault=f.executor_fault)
                for f, outcome in batch
                if f.claim.executor is not None
            ]
            outcomes = [outcome for _, outcome in batch]
            told = False
            try:
                if any(report.executor_fault for report in reports):
                    async with self.breaker_gate:
                        finish = await self._store(outcomes)
                        await self._breaker_record(reports, finish)
                        told = True
                else:
                    # Claim again as soon as the results are in; the breaker only records that the
                    # executors answered.
                    finish = await self._store(outcomes)
            except Exception as exc:  # not an outage (_store rides those out): recovery takes them
                self.log.error("finishing %d job(s) failed (%s); left to recovery", len(outcomes), exc)
                finish = None
            self.finished(batch, finish)
            if not told:
                await self._breaker_record(reports, finish)

    async def _store(self, outcomes: list[Outcome]) -> FinishReport | None:
        """`jobs_finish`, through outages for as long as `finish_patience` allows (None past it: the
        results are left to recovery). A batch the database refuses (bad data, not an outage) is
        written one by one, and a result it refuses alone fails its job with the reason."""
        try:
            return await self._retrying(
                jobs_finish, {"outcomes": outcomes, "wake_others": self.wake_others}, self.finish_patience
            )
        except DatabaseError as exc:
            if database_outage(exc):
                jobs = ", ".join(str(outcome.job_id) for outcome in outcomes)
                self.log.error("jobs %s: results could not be stored (%s); left to recovery", jobs, exc)
                return None
            if len(outcomes) > 1:
                return _merged([await self._store([outcome]) for outcome in outcomes])
            (outcome,) = outcomes
            self.log.error("job %d: result could not be stored (%s); failing the job", outcome.job_id, exc)
            stored = Outcome(
                job_id=outcome.job_id,
                lease=outcome.lease,
                ok=False,
                tokens_used=outcome.tokens_used,
                error=f"the result could not be stored: {exc}"[:2000],
            )
            return await self._retrying(
                jobs_finish, {"outcomes": [stored], "wake_others": self.wake_others}, self.finish_patience
            )

    async def dispatches_report(self, dispatches: list[DispatchReport]) -> None:
        """Tell the breakers how dispatches ended outside the finisher (a flow's round, whose end the
        round services write): the same one path to the breaker as a finished job's."""
        await self._breaker_record(dispatches, None)

    async def _breaker_record(self, reports: list[DispatchReport], finish: FinishReport | None) -> None:
        """Feed the breakers, in a transaction of its own after the finish's (job rows and executor
        rows are never locked together: scheduler/core/locks.py). A failed write is logged, never
        retried with the finish (that would refuse the results the first attempt wrote)."""
        clean = finish.clean if finish is not None else frozenset()
        if breaker_quiet(reports=reports, clean=clean):
            return  # nothing to write: no trip to a database thread
        try:
            events = await self.held_db(breaker_record, reports=reports, clean=clean)
        except DatabaseError as exc:
            self.log.warning("could not record dispatch outcomes for the breaker (%s)", exc)
            return
        for event in events:
            self.log.warning("executor %s: %s %s", event.meta.get("executor_name"), event.event, event.meta)

    async def db_retrying(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """A write about a held job that must not be lost (a release, a flow's round), retried
        through outages until the database answers."""
        return await self._retrying(fn, kwargs, None)

    async def _retrying(self, fn: Callable[..., T], kwargs: dict[str, Any], patience: float | None) -> T:
        """`held_db(fn, **kwargs)`, retried while the database is out of reach (a new connection
        may succeed), for `patience` seconds at most (None: until it answers); then the outage's
        error is raised. An error about the data itself is the caller's to handle."""
        deadline = None if patience is None else time.monotonic() + patience
        delay = 0.1
        while True:
            try:
                return await self.held_db(fn, **kwargs)
            except DatabaseError as exc:
                if not database_outage(exc) or (deadline is not None and time.monotonic() + delay > deadline):
                    raise
                self.log.warning("%s failed (%s); retrying in %.1fs", fn.__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --- leases -------------------------------------------------------------------------------------

    async def heartbeat(self) -> None:
        """Renew the flights' leases every `beat_interval()` while `beating()`."""
        while self.beating():
            await asyncio.sleep(self.beat_interval())
            self.beaten()
            await self._beat()

    async def _beat(self) -> None:
        held = {job_id: flight.claim.lease for job_id, flight in self.flights.items() if flight.abort_reason is None}
        if not held:
            return
        try:
            alive = await self.held_db(leases_renew, held=held)
        except DatabaseError as exc:
            self.log.warning("heartbeat failed (%s)", exc)
            deadline = time.monotonic() - self.lease_seconds
            for late in [flight for flight in self.flights.values() if flight.renewed_at < deadline]:
                self.abort(late.job_id, "lease lost")
            return
        now = time.monotonic()
        for job_id in held:
            if job_id not in alive:
                self.abort(job_id, "lease lost")
            elif (flight := self.flights.get(job_id)) is not None:
                flight.renewed_at = now


def _merged(reports: list[FinishReport | None]) -> FinishReport:
    """One report of finishes written one by one (one that could not be written counts nowhere)."""
    written = [report for report in reports if report is not None]
    costs: dict[int, Decimal] = {}
    for report in written:
        costs.update(report.costs)
    return FinishReport(
        accepted=[i for r in written for i in r.accepted],
        refused=[i for r in written for i in r.refused],
        retrying=[i for r in written for i in r.retrying],
        costs=costs,
        clean=frozenset(pk for r in written for pk in r.clean),
    )


async def _stop(flight: Flight) -> None:
    """Abort a flight: its driver stops its own call (closing an HTTP request upstream); anything
    else it is doing is cancelled outright."""
    assert flight.task is not None
    if flight.driver is None or not await flight.driver.cancel(flight.job_id):
        flight.task.cancel()


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
