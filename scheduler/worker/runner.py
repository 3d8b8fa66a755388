"""The scheduler worker: claims jobs, dispatches them to executors, heartbeats, finishes, recovers.

One asyncio loop keeps up to `concurrency` dispatches in flight (model calls are network I/O, so
hundreds are cheap). Database calls run in short transactions on dedicated threads, never while
a model call is awaited: claim, run, finish are separate steps. On PostgreSQL, claims (and
recovery and probes) take one thread and connection; the writes of the jobs this worker holds
(finishes, heartbeats, releases) another, so a finish never waits behind a claim (finishes do not
take the claim lock, so the two overlap in the database too). SQLite serializes writers, so there
a second connection would only wait for the first: everything shares one thread.

  claim loop   claims as many jobs as there are free local slots, then waits to be woken: by
               NOTIFY on PostgreSQL (work queued, capacity freed, configuration changed, a job
               canceled), by its own finishes, or on SQLite by a watch on its data_version
               (another connection committed), both heard through the process's listener
               (scheduler/notify/listener.py); and, when the claim said something waits on time
               (a retry's backoff, a breaker's cooldown, a budget window), at that moment.
  dispatches   one task per job; the driver's dispatch() runs outside any transaction. A flow's
               claim is one round (scheduler/flows/runner.py): model call, slot freed, tools in the
               tool threads, next round queued; a tool job runs in the tool threads; a governed
               slot is its app's to run (scheduler/flows/governed.py).
  finisher     writes results in batches (the finish is fenced by each job's lease).
  heartbeat    renews leases; a lease that is not renewed is lost and its dispatch is aborted,
               including when the database cannot be reached for longer than the lease.
  recovery     requeues or fails jobs whose lease expired (run at start and periodically).
  probes       checks executors' health (GET /models), each executor by one worker per interval.
  history      as each bucket closes, records the dashboard's history (the first worker to get
               there writes it, scheduler/services/history.py).

First SIGTERM/SIGINT: stop claiming, let in-flight work finish, exit. A second signal (or the
grace period running out): abort the dispatches and give their jobs back to the queue.
"""

import asyncio
import logging
import math
import signal
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.db import DatabaseError, InterfaceError, InternalError, OperationalError, close_old_connections, connection

from executors.contract import DispatchError, ExecutorDriver, Probe
from executors.health import DispatchReport, ExecutorEvent, breaker_quiet, breaker_record, probe_record, probes_due
from executors.models import Executor
from executors.registry import DriverPool
from scheduler.flows.runner import flow_round_run, tool_job_outcome
from scheduler.metrics import CLAIM_SECONDS, dispatch_observe, worker_heartbeat_forget, worker_heartbeat_observe
from scheduler.models import Job
from scheduler.notify import broadcast
from scheduler.notify.listener import Listener, Subscription
from scheduler.services.claim import Claim, job_claim
from scheduler.services.events import job_step_record
from scheduler.services.finish import FinishReport, Outcome, jobs_finish
from scheduler.services.history import history_next_in, history_record
from scheduler.services.lease import jobs_release, leases_renew
from scheduler.services.recover import jobs_recover
from scheduler.services.rounds import LeaseLost, RoundOutcome, rounds_end
from scheduler.worker.dispatch import failure_outcome, model_call_outcome, pooled_driver
from scheduler.worker.flight import InFlight
from scheduler.worker.probes import heartbeat_check, probe_serve
from telemachus.control import notify

log = logging.getLogger("telemachus.worker")
SQLITE_WATCH_SECONDS = 0.01
# Wake this much after a time-bound moment the claim named, so the database's clock has passed it.
TIME_WAKE_MARGIN = 0.005
T = TypeVar("T")


# Dispatches in flight per worker. Model calls wait on the network, so a worker holds many cheaply
# (about 31 KiB each, bench/dispatch.py); the caps, not this, protect the model servers. It is also
# the most jobs one claim can take, and a claim's fixed cost (lock, state, queue lookups) is
# shared by the jobs it takes: 64 drains no-op jobs about twice as fast as 16 (bench/throughput.py).
DEFAULT_CONCURRENCY = 64
# The longest a waiting worker sleeps with nothing waking it. Notifications, its own finishes and
# the claim's `wake_in` do the waking; this is a safety net for a bug in them, not how work flows.
DEFAULT_IDLE_POLL = 2.0
# The most flows' round ends one transaction writes.
ROUND_END_BATCH = 64


class Worker:
    def __init__(
        self,
        *,
        name: str,
        concurrency: int = DEFAULT_CONCURRENCY,
        burst: bool = False,
        poll_min: float = 0.05,
        poll_max: float = 1.0,
        idle_poll: float = DEFAULT_IDLE_POLL,
        grace: float | None = None,
    ) -> None:
        self.name = name
        self.concurrency = concurrency
        self.burst = burst
        self.poll_min, self.poll_max = poll_min, poll_max
        self.idle_poll = idle_poll
        self.lease_seconds = settings.TELEMACHUS_LEASE_SECONDS
        self.grace = grace
        self.inflight: dict[int, InFlight] = {}
        self.outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
        # Flows' rounds ended with their quick tools, written in batches (`_round_ender`).
        self.round_ends: asyncio.Queue[tuple[RoundOutcome, asyncio.Future[str | None]]] = asyncio.Queue()
        self.wake = asyncio.Event()
        self.breaker_gate = asyncio.Lock()
        self.to_release: dict[int, uuid.UUID] = {}
        self.drivers = DriverPool()
        self._ears: Subscription | None = None  # the process's listener, while running
        self.want_freed = True  # wake when capacity frees: work may be waiting for it
        self.freed = 0  # capacity-freed wake-ups so far (own finishes, `freed` notifications)
        self.stopping = False
        self.forced = False
        self._claim_thread = _database_thread("telemachus-claim")
        self._finish_thread = (
            _database_thread("telemachus-finish") if connection.vendor == "postgresql" else self._claim_thread
        )
        # Tools (a flow's calls between rounds, tool jobs) run here: never on the event loop, the
        # database threads or a model slot.
        self.tool_threads: futures.Executor = ThreadPoolExecutor(
            max_workers=settings.TELEMACHUS_TOOL_THREADS, thread_name_prefix="telemachus-tool"
        )
        self.processed = 0
        self.beat_at = time.monotonic()

    # --- database calls, on two threads ---------------------------------------------------------

    async def db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Claims, recovery, probes."""
        return await asyncio.get_running_loop().run_in_executor(self._claim_thread, partial(_db_call, fn, kwargs))

    async def held_db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Writes about the jobs this worker holds: finishes, heartbeats, releases."""
        return await asyncio.get_running_loop().run_in_executor(self._finish_thread, partial(_db_call, fn, kwargs))

    async def db_retrying(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """A write that must not be lost, retried through outages (see `_retrying`)."""
        return await self._retrying(fn, **kwargs)

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        self._install_signal_handlers()
        log.info(
            "worker %s starting: concurrency %d, lease %ds, %s",
            self.name,
            self.concurrency,
            self.lease_seconds,
            connection.vendor,
        )
        worker_heartbeat_observe(worker=self.name)
        await self._recover_once()
        background = [
            asyncio.create_task(self._finisher(), name="finisher"),
            asyncio.create_task(self._round_ender(), name="round-ender"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._recovery(), name="recovery"),
            asyncio.create_task(self._probes(), name="probes"),
            asyncio.create_task(self._history(), name="history"),
        ]
        probes = (
            await probe_serve(db=self.db, heartbeat=self._heartbeat_state) if settings.TELEMACHUS_METRICS_BIND else None
        )
        self._ears = Listener.current().subscribe(
            self, channels=[notify.WORKERS_CHANNEL], sqlite_interval=SQLITE_WATCH_SECONDS
        )
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            if probes is not None:
                probes.close()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._ears.aclose()
            for driver in self.drivers.all():
                await driver.aclose()
            for thread in {self._claim_thread, self._finish_thread}:
                await asyncio.get_running_loop().run_in_executor(thread, _close_connection)
                thread.shutdown(wait=True)
            self.tool_threads.shutdown(wait=False, cancel_futures=True)
        # Only a clean stop gets here: a worker that died keeps its last beat, for alerts to see.
        worker_heartbeat_forget(worker=self.name)
        log.info("worker %s stopped after %d jobs", self.name, self.processed)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # A shell runs background jobs with SIGINT ignored; keep it that way, so Ctrl-C in
            # `make run` reaches the worker once (through the script), not twice.
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            log.info(
                "worker %s stopping: draining %d in flight (signal again to abort them)", self.name, len(self.inflight)
            )
            if self.grace is not None:
                asyncio.get_running_loop().call_later(self.grace, self.force_stop)
        else:
            self.force_stop()
        self.wake.set()

    def force_stop(self) -> None:
        if self.forced:
            return
        self.forced = True
        log.info("worker %s aborting %d in flight; their jobs go back to the queue", self.name, len(self.inflight))
        for job_id in list(self.inflight):
            self._abort(job_id, "shutdown")

    async def _drain(self) -> None:
        while self.inflight or not self.outcomes.empty():
            await asyncio.sleep(0.02)
        if self.to_release:
            released = await self._retrying(jobs_release, held=self.to_release, reason=f"worker {self.name} shut down")
            log.info("released %d job(s) back to the queue: %s", len(released), released)

    # --- claiming -----------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        idle = self.poll_min
        while not self.stopping:
            free = self.concurrency - len(self.inflight)
            wake_in = None
            if free > 0:
                freed = self.freed
                try:
                    async with self.breaker_gate:
                        started = time.perf_counter()
                        batch = await self.db(job_claim, worker=self.name, limit=free)
                        CLAIM_SECONDS.observe(time.perf_counter() - started)
                except DatabaseError as exc:
                    log.warning("claim failed (%s); retrying in %.1fs", exc, idle)
                    await self._sleep(idle)
                    idle = min(idle * 2, self.poll_max)
                    continue
                except Exception:  # a bug or a bad setting must not end the worker: log, back off, go on
                    log.exception("claim raised; retrying in %.1fs", self.poll_max)
                    await self._sleep(self.poll_max)
                    continue
                for claim in batch.claims:
                    self._start(claim)
                self.want_freed = batch.backlog
                # Took all it could, or capacity was freed while it claimed (a wake-up that came
                # before it knew work was waiting, so nothing was set): claim again now.
                if len(batch.claims) == free or (batch.backlog and self.freed != freed):
                    idle = self.poll_min
                    continue
                if batch.claims:
                    idle = self.poll_min
                wake_in = batch.wake_in
            else:
                self.want_freed = True
            if self.burst and not self.inflight and self.outcomes.empty():
                log.info("worker %s: queue drained (burst mode)", self.name)
                return
            await self._wait_for_wake(idle, wake_in)
            idle = min(idle * 2, self.poll_max)

    async def _wait_for_wake(self, idle: float, wake_in: float | None) -> None:
        # With LISTEN (or SQLite's watch), notifications do the waking; the timer is a safety net.
        timeout = self.idle_poll if self.listening or self.watching else idle
        if wake_in is not None:
            timeout = min(timeout, wake_in + TIME_WAKE_MARGIN)
        try:
            await asyncio.wait_for(self.wake.wait(), timeout)
        except TimeoutError:
            pass
        self.wake.clear()

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.wake.wait(), seconds)
        except TimeoutError:
            pass

    # --- dispatching --------------------------------------------------------------------------

    def _start(self, claim: Claim) -> None:
        job, now = claim.job, time.monotonic()
        where = claim.executor.name if claim.executor is not None else "the tool threads"
        log.info("job %d claimed: %s on %s (team %s, attempt %d)", job.pk, job.type, where, job.team_id, job.attempts)
        if job.type == Job.Type.GOVERNED:
            return  # its app holds the lease from here (scheduler/flows/governed.py)
        try:
            driver = self._driver(claim.executor) if claim.executor is not None else None
        except Exception as exc:  # a driver that cannot be built fails its job, never the worker
            assert claim.executor is not None
            log.error("job %d: no driver for executor %s: %s", job.pk, claim.executor.name, exc)
            self.inflight[job.pk] = InFlight(claim=claim, driver=None, renewed_at=now, started=now, executor_fault=True)
            self.outcomes.put_nowait(
                Outcome(
                    job_id=job.pk,
                    lease=claim.lease,
                    ok=False,
                    error=f"executor {claim.executor.name} has no usable driver: {exc}",
                )
            )
            return
        flight = InFlight(claim=claim, driver=driver, renewed_at=now, started=now)
        self.inflight[job.pk] = flight
        flight.task = asyncio.create_task(self._dispatch(flight), name=f"job-{job.pk}")

    def _driver(self, executor: Executor) -> ExecutorDriver:
        return pooled_driver(self.drivers, executor)

    async def _dispatch(self, flight: InFlight) -> None:
        job = flight.claim.job
        started = time.perf_counter()
        on_delta: broadcast.DeltaStream | None = None
        try:
            if job.type == Job.Type.FLOW:
                await flow_round_run(self, flight)  # writes its own end
                return
            if job.type == Job.Type.TOOL:
                outcome = await tool_job_outcome(self, flight.claim)
            else:
                on_delta = broadcast.DeltaStream(job.pk, attempt=job.attempts) if job.input.get("stream") else None
                assert flight.driver is not None  # only tool jobs run without an executor
                outcome, flight.executor_fault = await model_call_outcome(
                    driver=flight.driver,
                    claim=flight.claim,
                    on_delta=on_delta,
                    on_step=partial(self._step_record, flight),
                    started=flight.started,
                )
        except asyncio.CancelledError:
            self.inflight.pop(job.pk, None)
            if flight.abort_reason == "shutdown":
                self.to_release[job.pk] = flight.claim.lease
            log.info("job %d dispatch aborted: %s", job.pk, flight.abort_reason or "cancelled")
            if flight.abort_reason is None:
                raise
            self._capacity_freed()
            return
        except DispatchError as exc:
            dispatch_observe(executor=flight.claim.executor, outcome="error", seconds=time.perf_counter() - started)
            flight.executor_fault = exc.executor_fault
            outcome = failure_outcome(flight.claim, exc)
        except Exception as exc:  # a bug must fail the job, not kill the worker
            log.exception("job %d: %s raised", job.pk, f"driver {flight.driver.kind}" if flight.driver else "its run")
            outcome = Outcome(job_id=job.pk, lease=flight.claim.lease, ok=False, error=f"driver error: {exc!r}")
        if on_delta is not None:
            await on_delta.flush()  # the output goes out before the end that the finish announces
        await self.outcomes.put(outcome)

    async def _step_record(self, flight: InFlight, meta: dict[str, Any]) -> None:
        """What the driver reported during the dispatch (a batch job's id): a `step` event."""
        claim = flight.claim
        executor_id = claim.executor.pk if claim.executor is not None else None
        await self.held_db(
            job_step_record, job_id=claim.job.pk, executor_id=executor_id, attempt=claim.job.attempts, **meta
        )

    def _abort(self, job_id: int, reason: str) -> None:
        flight = self.inflight.get(job_id)
        if flight is None or flight.abort_reason is not None:
            return
        flight.abort_reason = reason
        if flight.task is not None and not flight.task.done():
            log.info("job %d: aborting dispatch (%s)", job_id, reason)
            asyncio.create_task(_stop(flight))

    def flight_ended(self, job_id: int, *, queued: bool = False) -> None:
        """A flight that wrote its own end (a flow's round) leaves: its capacity is free. `queued`:
        it queued the flow's next round telling no other worker, so this one claims at once."""
        self.inflight.pop(job_id, None)
        self.processed += 1
        self._capacity_freed()
        if queued:
            self.wake.set()

    def _capacity_freed(self) -> None:
        self.freed += 1
        if self.want_freed or self.stopping:
            self.wake.set()

    # --- finishing ----------------------------------------------------------------------------

    async def _finisher(self) -> None:
        while True:
            batch = [await self.outcomes.get()]
            while not self.outcomes.empty() and len(batch) < 256:
                batch.append(self.outcomes.get_nowait())
            dispatches = [
                DispatchReport(executor_id=f.claim.executor.pk, ok=outcome.ok, executor_fault=f.executor_fault)
                for outcome in batch
                if (f := self.inflight.get(outcome.job_id)) is not None and f.claim.executor is not None
            ]
            if any(d.executor_fault for d in dispatches):
                # No claim of this worker runs between an executor's failure and its breaker
                # hearing of it (the breaker may take the executor out of placement).
                async with self.breaker_gate:
                    report = await self._finish(batch)
                    breaker_events = await self._breaker_record(dispatches, clean=report.clean)
                self._finished(batch, report)
            else:
                # Claim again as soon as the results are in; the breaker only records that the
                # executors answered.
                report = await self._finish(batch)
                self._finished(batch, report)
                breaker_events = await self._breaker_record(dispatches, clean=report.clean)
            for event in breaker_events:
                log.warning("executor %s: %s %s", event.meta.get("executor_name"), event.event, event.meta)

    def _finished(self, batch: list[Outcome], report: FinishReport) -> None:
        """The batch's results are stored: its jobs leave this worker, which may claim again."""
        refused, retrying = set(report.refused), set(report.retrying)
        for outcome in batch:
            self.inflight.pop(outcome.job_id, None)
            self.processed += 1
            if outcome.job_id in refused:
                log.warning("job %d: result refused (lease no longer held); dropped", outcome.job_id)
            elif outcome.job_id in retrying:
                log.info("job %d failed, will retry: %s", outcome.job_id, outcome.error)
            elif outcome.ok:
                log.info("job %d done (%s tokens)", outcome.job_id, outcome.tokens_used)
            else:
                log.info("job %d failed: %s", outcome.job_id, outcome.error)
        self._capacity_freed()

    async def _finish(self, batch: list[Outcome]) -> FinishReport:
        """Write a batch of results. A result the database refuses (not an outage: bad data) is
        isolated by writing the batch one by one, and that job fails with the reason instead of
        blocking every later result of this worker. A worker's finishes wake only itself (it has
        the room to claim what it freed), unless it is stopping."""
        try:
            return await self._retrying(jobs_finish, outcomes=batch, wake_others=self.stopping)
        except DatabaseError as exc:
            if len(batch) > 1:
                reports = [await self._finish([outcome]) for outcome in batch]
                return FinishReport(
                    accepted=[i for r in reports for i in r.accepted],
                    refused=[i for r in reports for i in r.refused],
                    retrying=[i for r in reports for i in r.retrying],
                )
            (outcome,) = batch
            log.error("job %d: result could not be stored (%s); failing the job", outcome.job_id, exc)
            stored = Outcome(
                job_id=outcome.job_id,
                lease=outcome.lease,
                ok=False,
                tokens_used=outcome.tokens_used,
                error=f"the result could not be stored: {exc}"[:2000],
            )
            return await self._retrying(jobs_finish, outcomes=[stored], wake_others=self.stopping)

    async def round_end(self, end: RoundOutcome) -> str:
        """Write a flow's round's end and its requeue (`rounds_end`), batched with the other rounds
        of this worker that end meanwhile, as results are, and report to the breaker that its
        executor answered; returns the job's status. Raises LeaseLost when the write is refused
        (the lease no longer holds the job at that round)."""
        written: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        await self.round_ends.put((end, written))
        status = await written
        if status is None:
            raise LeaseLost(f"Lease {end.lease} no longer holds job {end.job_id} at round {end.round}.")
        return status

    async def _round_ender(self) -> None:
        while True:
            batch = [await self.round_ends.get()]
            while not self.round_ends.empty() and len(batch) < ROUND_END_BATCH:
                batch.append(self.round_ends.get_nowait())
            try:
                written = await self._retrying(rounds_end, ends=[end for end, _ in batch], wake_others=self.stopping)
            except Exception as exc:  # bad data, not an outage: each round's runner ends its job
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            answered = [
                DispatchReport(executor_id=f.claim.executor.pk, ok=True, executor_fault=False)
                for end, _ in batch
                if (f := self.inflight.get(end.job_id)) is not None and f.claim.executor is not None
            ]
            for end, future in batch:
                if not future.done():
                    future.set_result(written.get(end.job_id))
            # The servers answered: one report for the batch, after the rounds' flights have ended
            # (so the worker claims first), in a transaction of its own.
            await self.dispatches_report(answered)

    async def dispatches_report(self, dispatches: list[DispatchReport]) -> None:
        """Tell the breakers how dispatches ended, outside the finisher (a flow's round, whose end
        the round services write): the same one path to the breaker as a finished job's."""
        for event in await self._breaker_record(dispatches):
            log.warning("executor %s: %s %s", event.meta.get("executor_name"), event.event, event.meta)

    async def _breaker_record(
        self, dispatches: list[DispatchReport], *, clean: frozenset[int] = frozenset()
    ) -> list[ExecutorEvent]:
        """Feed the breakers, in a transaction of its own after the finish's (job rows and executor
        rows are never locked together: scheduler/core/locks.py). A failed write is logged, never
        retried with the finish (that would refuse the results the first attempt wrote)."""
        if breaker_quiet(reports=dispatches, clean=clean):
            return []  # nothing to write: no trip to a database thread
        try:
            return await self.held_db(breaker_record, reports=dispatches, clean=clean)
        except DatabaseError as exc:
            log.warning("could not record dispatch outcomes for the breaker (%s)", exc)
            return []

    async def _retrying(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Writes that must not be lost (results, releases) are retried until the database answers.
        Results written after the lease ran out are refused by fencing, which is correct. Only
        outages are retried; an error about the data itself is the caller's to handle."""
        delay = 0.1
        while True:
            try:
                return await self.held_db(fn, **kwargs)
            except DatabaseError as exc:
                if not database_outage(exc):
                    raise
                log.warning("%s failed (%s); retrying in %.1fs", fn.__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --- leases -------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        # Without LISTEN, the heartbeat is also how a cancel reaches us: beat faster.
        while True:
            interval = self._heartbeat_interval()
            await asyncio.sleep(interval)
            self.beat_at = time.monotonic()
            worker_heartbeat_observe(worker=self.name)
            held = {job_id: f.claim.lease for job_id, f in self.inflight.items() if f.abort_reason is None}
            if not held:
                continue
            try:
                alive = await self.held_db(leases_renew, held=held)
            except DatabaseError as exc:
                log.warning("heartbeat failed (%s)", exc)
                deadline = time.monotonic() - self.lease_seconds
                for job_id in list(self.inflight):
                    if self.inflight[job_id].renewed_at < deadline:
                        self._abort(job_id, "lease lost")
                continue
            now = time.monotonic()
            for job_id in held:
                if job_id in alive:
                    if job_id in self.inflight:
                        self.inflight[job_id].renewed_at = now
                else:
                    self._abort(job_id, "lease lost")

    def _heartbeat_interval(self) -> float:
        return self.lease_seconds / 3 if self.listening else min(self.lease_seconds / 3, 1.0)

    def _heartbeat_state(self) -> str:
        return heartbeat_check(beat_at=self.beat_at, interval=self._heartbeat_interval())

    async def _recover_once(self) -> None:
        try:
            report = await self.db(jobs_recover)
        except DatabaseError as exc:
            log.warning("recovery failed (%s)", exc)
            return
        if report.requeued or report.failed:
            log.info("recovered expired leases: requeued %s, failed %s", report.requeued, report.failed)
            self.wake.set()

    async def _recovery(self) -> None:
        while True:
            await asyncio.sleep(max(self.lease_seconds / 2, 1.0))
            await self._recover_once()

    async def _history(self) -> None:
        while True:
            await asyncio.sleep(history_next_in())
            try:
                await self.db(history_record)
            except DatabaseError as exc:
                log.warning("recording the dashboard's history failed (%s)", exc)

    # --- health probes ------------------------------------------------------------------------

    async def _probes(self) -> None:
        interval = settings.TELEMACHUS_PROBE_INTERVAL_SECONDS
        while True:
            try:
                due = await self.db(probes_due, interval=interval)
                if due:
                    results = await asyncio.gather(*(self._probe(executor) for executor in due))
                    for event in await self.db(probe_record, results=results):
                        log.warning(
                            "executor %s: health %s -> %s (%s)",
                            event.meta["executor_name"],
                            event.meta["was"],
                            event.meta["health"],
                            event.meta["detail"],
                        )
            except DatabaseError as exc:
                log.warning("probing failed (%s)", exc)
            await asyncio.sleep(min(interval, 5.0))

    async def _probe(self, executor: Executor) -> tuple[int, Probe]:
        try:
            return executor.pk, await asyncio.wait_for(self._driver(executor).probe(), timeout=30)
        except Exception as exc:  # a probe that crashes says the executor cannot be trusted
            return executor.pk, Probe(health=Executor.Health.DOWN, detail=f"probe error: {exc!r}")

    # --- notifications (scheduler/notify/listener.py) -------------------------------------------

    @property
    def listening(self) -> bool:
        """PostgreSQL: wake-ups (and cancels) arrive by NOTIFY now."""
        return self._ears is not None and self._ears.live and connection.vendor == "postgresql"

    @property
    def watching(self) -> bool:
        """SQLite: the data_version watch is running."""
        return self._ears is not None and self._ears.live and connection.vendor == "sqlite"

    def notified(self, channel: str, payload: str) -> None:
        if payload in (notify.QUEUED, notify.CONFIG_CHANGED):
            self.wake.set()
        elif payload == notify.FREED:
            self._capacity_freed()
        elif payload.startswith(f"{notify.CANCELED}:"):
            job_id = int(payload.partition(":")[2])
            if job_id in self.inflight:
                self._abort(job_id, "canceled")

    def missed(self) -> None:
        """Listening again (or, on SQLite, another connection committed): anything may be waiting."""
        self.wake.set()

    def live_changed(self, live: bool) -> None:
        """Nothing to do: the claim loop and the heartbeat read `listening` each time round."""


def _database_thread(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_persistent_connection)


def _persistent_connection() -> None:
    """A worker's database thread keeps its connection (no per-call reconnect), its own rather
    than one from the pool the API processes share, with the worker's session settings."""
    connection.settings_dict.update(worker_database_settings(connection.settings_dict))


def worker_database_settings(settings_dict: dict[str, Any]) -> dict[str, Any]:
    """A worker's connection settings, from the process's: no pool, kept open, not pinged before
    each use (CONN_HEALTH_CHECKS off: Django would send `SELECT 1` before the first statement after
    every `close_old_connections()`, a round trip before each claim and finish), and on PostgreSQL
    `idle_in_transaction_session_timeout` (TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS). A
    connection used only by its own loop is checked on error instead: a call that finds it broken
    fails as an outage (`database_outage`), which the loop retries or backs off from, and the next
    `close_old_connections()` closes it (Django flags a connection that saw an error), so the retry
    reconnects (tests/concurrency/test_faults.py cuts them fifty times, and restarts the server). A
    worker frozen mid-transaction (stopped, swapped out, stuck in a pause) would otherwise hold its
    locks until it resumes, the claim lock included, and every claim on every host would wait; the
    server ends such a session after the timeout, its transaction rolled back, and the worker's
    next call reconnects. Transactions here never wait on anything but the database.

    Behind a transaction pooler (TELEMACHUS_PGBOUNCER) a session setting cannot reach the server:
    PgBouncer refuses the `options` startup parameter, or drops it when told to ignore it. There
    the pooler's `idle_transaction_timeout` is the bound (it disconnects the client and closes the
    server connection, which rolls back), so none is sent."""
    options = {k: v for k, v in (settings_dict.get("OPTIONS") or {}).items() if k != "pool"}
    timeout = settings.TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS
    postgres = settings_dict.get("ENGINE") == "django.db.backends.postgresql"
    if postgres and timeout > 0 and not settings.TELEMACHUS_PGBOUNCER:
        flag = f"-c idle_in_transaction_session_timeout={math.ceil(timeout * 1000)}"
        options["options"] = f"{options.get('options', '')} {flag}".strip()
    return {**settings_dict, "OPTIONS": options, "CONN_MAX_AGE": None, "CONN_HEALTH_CHECKS": False}


def _close_connection() -> None:
    connection.close()


def database_outage(exc: DatabaseError) -> bool:
    """Whether the error says the connection failed (retry on a new one), not that the data was
    refused. Behind a transaction pooler (PgBouncer) a server connection terminated while idle in
    the pool answers the next client's BEGIN or COMMIT with its FATAL error and the command's own
    result, which psycopg reports as InternalError "received 2 results from command 'BEGIN'"."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, InternalError) and "results from command" in str(exc)


def _db_call(fn: Callable[..., T], kwargs: dict[str, Any]) -> T:
    # After a database error Django flags the connection; this closes it if it is broken
    # (database restarted, network cut), so the call reconnects instead of failing forever.
    close_old_connections()
    return fn(**kwargs)


async def _stop(flight: InFlight) -> None:
    """Abort a flight: its driver stops its own call (closing an HTTP request upstream); anything
    else it is doing (a flow's tools, a tool job, a write) is cancelled outright, and the fenced
    write that would follow is refused anyway."""
    assert flight.task is not None
    if flight.driver is None or not await flight.driver.cancel(flight.claim.job.pk):
        flight.task.cancel()
