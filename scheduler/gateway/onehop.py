"""One hop: an API process runs the model call it holds itself when the call can run now.

Without it, a call goes submit → NOTIFY → a worker's claim → dispatch → finish → NOTIFY → the API
process reads the job and answers: two trips through the database's notifications and a read.
With it (TELEMACHUS_GATEWAY_ONE_HOP, on by default), the API process claims the job right after
its submit, through the claim every worker uses (`job_claim`, restricted by `only`), dispatches it
to the executor's driver in this process, finishes it through `jobs_finish`, and answers from the
outcome it holds. The reasoning, ordering and caps: docs/gateway.md ("One hop").

What the process keeps here is what a worker keeps for a claim, and is held to the same rules:

  claim      one thread with a connection of its own and the worker's session settings (an
             idle-in-transaction timeout, so a process frozen inside a claim cannot hold the claim
             lock); calls waiting to be claimed are claimed together, in one claim.
  lease      a heartbeat renews the leases of the calls in flight every third of the lease; a lease
             that is not renewed (lost, recovered, the job canceled) aborts its dispatch. A process
             that dies leaves expired leases, which the workers' recovery requeues or fails.
  finish     fenced by the lease, as a worker's: a job completes once. Calls whose dispatches end
             while a finish is being written are finished together, in one `jobs_finish`, as a
             worker finishes its batch (fewer commits under load; at one call, no wait).
  breaker    each batch's dispatch ends are told to the executors' breakers, as the worker does.
"""

import asyncio
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from typing import Any

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, close_old_connections, connection

from executors.contract import ExecutorDriver
from executors.health import DispatchReport, breaker_quiet, breaker_record
from executors.registry import DriverPool
from scheduler.gateway.database import db
from scheduler.gateway.feed import Delta, JobFeed
from scheduler.metrics import CLAIM_SECONDS
from scheduler.notify import broadcast
from scheduler.services.claim import Claim, job_claim
from scheduler.services.events import job_step_record
from scheduler.services.finish import FinishReport, Outcome, jobs_finish
from scheduler.services.lease import leases_renew
from scheduler.worker.dispatch import model_call_outcome, pooled_driver
from scheduler.worker.runner import database_outage, worker_database_settings
from telemachus.control import notify

log = logging.getLogger("telemachus.gateway")


def enabled() -> bool:
    return bool(settings.TELEMACHUS_GATEWAY_ONE_HOP)


@dataclass
class Flight:
    """A call this process claimed and runs. `result` and `cost` are set when its finish was
    accepted with a result: the call answers from them, without reading the job."""

    claim: Claim
    driver: ExecutorDriver | None = None
    task: asyncio.Task[None] | None = None
    renewed_at: float = 0.0
    aborted: str | None = None
    # Its dispatch has ended and its finish is being written: the job ends through this process,
    # which tells the call's watch when (`settled`), so a notification of that end heard first
    # needs no read of the job.
    finishing: bool = False
    settled: bool = False  # its run is over, however it ended
    result: dict[str, Any] | None = None
    cost: Decimal | None = None

    @property
    def job_id(self) -> int:
        return self.claim.job.pk

    @property
    def answered(self) -> bool:
        return self.cost is not None


class OwnCalls:
    """The calls one API process (one event loop) claims and runs itself."""

    _instances: dict[asyncio.AbstractEventLoop, "OwnCalls"] = {}

    def __init__(self) -> None:
        self.name = f"api:{socket.gethostname()}:{os.getpid()}"
        self.lease_seconds = settings.TELEMACHUS_LEASE_SECONDS
        self.flights: dict[int, Flight] = {}
        self.drivers = DriverPool()
        self.breaker_gate = asyncio.Lock()
        self._wanted: dict[int, asyncio.Future[Flight | None]] = {}
        self._claimer: asyncio.Task[None] | None = None
        self._ending: list[tuple[Flight, Outcome, DispatchReport, asyncio.Future[None]]] = []
        self._finisher: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._claim_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="telemachus-api-claim", initializer=_claim_connection
        )

    @classmethod
    def current(cls) -> "OwnCalls":
        loop = asyncio.get_running_loop()
        calls = cls._instances.get(loop)
        if calls is None:
            cls._instances = {lp: c for lp, c in cls._instances.items() if not lp.is_closed()}
            calls = cls._instances[loop] = cls()
        return calls

    # --- claiming -------------------------------------------------------------------------------

    async def claim(self, job_id: int) -> Flight | None:
        """Claim the just-submitted job, if the claim would take it now; start running it. None:
        it stays queued (the workers were woken for it)."""
        future: asyncio.Future[Flight | None] = asyncio.get_running_loop().create_future()
        self._wanted[job_id] = future
        if self._claimer is None or self._claimer.done():
            self._claimer = asyncio.create_task(self._claim_waiting(), name="onehop-claim")
        return await future

    async def _claim_waiting(self) -> None:
        """Claim every call waiting to be claimed, in one claim, until none waits."""
        while self._wanted:
            wanted, self._wanted = self._wanted, {}
            claims: dict[int, Claim] = {}
            try:
                async with self.breaker_gate:
                    started = time.perf_counter()
                    batch = await asyncio.get_running_loop().run_in_executor(
                        self._claim_thread,
                        partial(_claim_call, worker=self.name, only=frozenset(wanted), limit=len(wanted)),
                    )
                    CLAIM_SECONDS.observe(time.perf_counter() - started)
                claims = {claim.job.pk: claim for claim in batch.claims}
                if len(claims) < len(wanted):
                    left = sorted(set(wanted) - set(claims))
                    log.debug("calls left to the workers (not next in the claim's order): %s", left)
            except Exception as exc:  # the calls wait for a worker instead; their submit did not wake one
                log.warning("claiming %d call(s) in process failed (%s); left to the workers", len(wanted), exc)
                try:
                    await db(_wake_workers)
                except DatabaseError:
                    pass  # the workers' own timer finds them
            for job_id, future in wanted.items():
                claim = claims.get(job_id)
                flight = self._start(claim) if claim is not None else None
                if not future.done():
                    future.set_result(flight)

    # --- running --------------------------------------------------------------------------------

    def _start(self, claim: Claim) -> Flight:
        flight = Flight(claim=claim, renewed_at=time.monotonic())
        self.flights[flight.job_id] = flight
        flight.task = asyncio.create_task(self._run(flight), name=f"onehop-{flight.job_id}")
        if self._beat is None or self._beat.done():
            self._beat = asyncio.create_task(self._heartbeat(), name="onehop-heartbeat")
        return flight

    async def _run(self, flight: Flight) -> None:
        """Dispatch, finish, tell the call, then the breaker: a worker's flight, in this process."""
        claim, job = flight.claim, flight.claim.job
        started = time.monotonic()
        log.info("job %d claimed in process: %s on %s (attempt %d)", job.pk, job.type, claim.executor, job.attempts)
        try:
            assert claim.executor is not None  # a /v1/ call is a model call: it holds a slot
            try:
                flight.driver = pooled_driver(self.drivers, claim.executor)
            except Exception as exc:  # a driver that cannot be built fails its job, as in the worker
                log.error("job %d: no driver for executor %s: %s", job.pk, claim.executor.name, exc)
                error = f"executor {claim.executor.name} has no usable driver: {exc}"
                outcome, fault = Outcome(job_id=job.pk, lease=claim.lease, ok=False, error=error), True
            try:
                if flight.driver is not None:
                    sink = LocalDeltas(job.pk, attempt=job.attempts) if job.input.get("stream") else None
                    outcome, fault = await model_call_outcome(
                        driver=flight.driver,
                        claim=claim,
                        on_delta=sink,
                        on_step=partial(_step_record, claim),
                        started=started,
                    )
                    if sink is not None:
                        await sink.flush()
            except asyncio.CancelledError:
                log.info("job %d: in-process dispatch aborted: %s", job.pk, flight.aborted or "cancelled")
                return
            report = DispatchReport(executor_id=claim.executor.pk, ok=outcome.ok, executor_fault=fault)
            flight.finishing = True
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._ending.append((flight, outcome, report, done))
            if self._finisher is None or self._finisher.done():
                self._finisher = asyncio.create_task(self._finish_ended(), name="onehop-finish")
            await done
        finally:
            self.flights.pop(flight.job_id, None)
            flight.settled = True
            JobFeed.current().ended_here(flight.job_id)

    async def _finish_ended(self) -> None:
        """Finish every flight whose dispatch has ended, in one `jobs_finish`, until none waits;
        then tell the breakers. A batch with an executor fault holds the breaker gate throughout:
        no claim of this process runs between an executor's failure and its breaker hearing of
        it, as in the worker."""
        while self._ending:
            batch, self._ending = self._ending, []
            outcomes = [outcome for _, outcome, _, _ in batch]
            reports = [report for _, _, report, _ in batch]
            try:
                if any(report.executor_fault for report in reports):
                    async with self.breaker_gate:
                        finished = await self._finish(outcomes)
                        await self._breaker(reports, finished)
                    self._all_ended(batch, finished)
                else:
                    finished = await self._finish(outcomes)
                    self._all_ended(batch, finished)
                    await self._breaker(reports, finished)
            except Exception as exc:  # not an outage (_finish rides those out): recovery takes them
                log.error("finishing %d in-process call(s) failed (%s); left to recovery", len(batch), exc)
                self._all_ended(batch, None)

    def _all_ended(
        self, batch: list[tuple[Flight, Outcome, DispatchReport, asyncio.Future[None]]], report: FinishReport | None
    ) -> None:
        for flight, outcome, _, done in batch:
            self._ended(flight, outcome, report)
            if not done.done():
                done.set_result(None)

    def _ended(self, flight: Flight, outcome: Outcome, report: FinishReport | None) -> None:
        """The finish is written (or refused): the call may answer from it, without a read."""
        if report is not None and outcome.ok and flight.job_id in report.accepted:
            flight.result, flight.cost = outcome.result, report.costs.get(flight.job_id, Decimal(0))
        elif report is not None and flight.job_id in report.refused:
            log.warning("job %d: result refused (lease no longer held); dropped", flight.job_id)

    async def _finish(self, outcomes: list[Outcome]) -> FinishReport | None:
        """`jobs_finish`, retried through an outage while the leases may still hold; after that
        the finish would be refused anyway, and recovery takes the jobs back."""
        deadline, delay = time.monotonic() + self.lease_seconds, 0.1
        jobs = ", ".join(str(outcome.job_id) for outcome in outcomes)
        while True:
            try:
                return await db(jobs_finish, outcomes=outcomes)
            except (OperationalError, InterfaceError) as exc:
                if time.monotonic() + delay > deadline:
                    log.error("jobs %s: results could not be stored (%s); left to recovery", jobs, exc)
                    return None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except DatabaseError as exc:
                log.error("jobs %s: results could not be stored (%s); left to recovery", jobs, exc)
                return None

    async def _breaker(self, reports: list[DispatchReport], finished: FinishReport | None) -> None:
        clean = finished.clean if finished is not None else frozenset()
        if breaker_quiet(reports=reports, clean=clean):
            return  # nothing to write: no trip to a database thread
        try:
            events = await db(breaker_record, reports=reports, clean=clean)
        except DatabaseError as exc:
            log.warning("could not record a dispatch outcome for the breaker (%s)", exc)
            return
        for event in events:
            log.warning("executor %s: %s %s", event.meta.get("executor_name"), event.event, event.meta)

    def abort(self, flight: Flight, reason: str) -> None:
        """Stop a flight's dispatch (its job was canceled, or its lease is lost): the driver closes
        its request upstream; a finish that would follow is refused anyway. A flight whose dispatch
        has ended has nothing left to stop: its finish is under way."""
        if flight.aborted is not None or flight.finishing or flight.task is None or flight.task.done():
            return
        flight.aborted = reason
        asyncio.create_task(_stop(flight))

    # --- leases ---------------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        """Renew the leases of the calls in flight, as the worker's heartbeat does; stops when
        none is in flight (the next claim starts it again)."""
        while self.flights:
            await asyncio.sleep(self.lease_seconds / 3)
            held = {job_id: f.claim.lease for job_id, f in self.flights.items() if f.aborted is None}
            if not held:
                continue
            try:
                alive = await db(leases_renew, held=held)
            except DatabaseError as exc:
                log.warning("heartbeat of in-process calls failed (%s)", exc)
                deadline = time.monotonic() - self.lease_seconds
                for late in list(self.flights.values()):
                    if late.renewed_at < deadline:
                        self.abort(late, "lease lost")
                continue
            now = time.monotonic()
            for job_id in held:
                flight = self.flights.get(job_id)
                if flight is None:
                    continue
                if job_id in alive:
                    flight.renewed_at = now
                else:
                    self.abort(flight, "lease lost")


class LocalDeltas:
    """A streamed in-process call's output: to this process's watchers at once (the call itself
    relays it with no trip through the database), and to every other process as a worker's
    output goes (scheduler/notify/broadcast.py), for their job streams."""

    def __init__(self, job_id: int, *, attempt: int) -> None:
        self.job_id, self.attempt = job_id, attempt
        self.broadcast = broadcast.DeltaStream(job_id, attempt=attempt)
        self.feed = JobFeed.current()

    async def __call__(self, text: str, *, tool: tuple[int, str, str] | None = None) -> None:
        if tool is None:
            delta = Delta(self.attempt, self.broadcast.sent, text)
        else:
            index, ident, name = tool
            delta = Delta(
                self.attempt, self.broadcast.tool_sent.get(index, 0), text, broadcast.tool_part(index), ident, name
            )
        self.feed.delta_here(self.job_id, delta)
        await self.broadcast(text, tool=tool)

    async def flush(self) -> None:
        await self.broadcast.flush()


def _claim_connection() -> None:
    """The claim thread's connection: its own, kept open, with the worker's session settings (a
    new settings dict for this thread's connection; the process's stays as it is)."""
    connection.settings_dict = worker_database_settings(connection.settings_dict)


def _claim_call(*, worker: str, only: frozenset[int], limit: int) -> Any:
    """The claim, on the claim thread's connection. That connection is not pinged before each
    claim (the worker's settings turn CONN_HEALTH_CHECKS off: a round trip per claim); one found
    broken by the claim itself (the server restarted, the session was ended) is closed and the
    claim tried once more on a new connection. The failed claim changed nothing, unless its commit
    reached the server before the connection broke: then its jobs are running under a lease nobody
    holds, the second claim does not find them queued, and recovery takes them back when the lease
    expires, as it would have without the second try."""
    close_old_connections()  # one that saw an error and no longer answers: closed, reopened
    try:
        return job_claim(worker=worker, only=only, limit=limit)
    except DatabaseError as exc:
        if not database_outage(exc):
            raise
        connection.close()
        return job_claim(worker=worker, only=only, limit=limit)


async def _step_record(claim: Claim, meta: dict[str, Any]) -> None:
    """What the driver reported during the dispatch: a `step` event, as the worker records it."""
    executor_id = claim.executor.pk if claim.executor is not None else None
    await db(job_step_record, job_id=claim.job.pk, executor_id=executor_id, attempt=claim.job.attempts, **meta)


def _wake_workers() -> None:
    notify.notify_workers(notify.QUEUED)


async def _stop(flight: Flight) -> None:
    assert flight.task is not None
    if flight.driver is None or not await flight.driver.cancel(flight.job_id):
        flight.task.cancel()
