"""One hop: an API process runs the model call it holds itself when the call can run now.

Without it, a call goes submit → NOTIFY → a worker's claim → dispatch → finish → NOTIFY → the API
process reads the job and answers: two trips through the database's notifications and a read.
With it (TELEMACHUS_GATEWAY_ONE_HOP, on by default), the API process claims the job right after
its submit, through the claim every worker uses (`job_claim`, restricted by `only`), dispatches it
to the executor's driver in this process, finishes it through `jobs_finish`, and answers from the
outcome it holds. The reasoning, ordering and caps: docs/gateway.md ("One hop").

What the process keeps of the calls it runs is a worker's: the same flight host
(scheduler/worker/host.py), held to the same rules.

  claim      one thread with a connection of its own and the worker's session settings (an
             idle-in-transaction timeout, so a process frozen inside a claim cannot hold the claim
             lock); calls waiting to be claimed are claimed together, in one claim.
  lease      a heartbeat renews the leases of the calls in flight every third of the lease; a lease
             that is not renewed (lost, recovered, the job canceled) aborts its dispatch. A process
             that dies leaves expired leases, which the workers' recovery requeues or fails.
  finish     fenced by the lease, as a worker's: a job completes once. Calls whose dispatches end
             while a finish is being written are finished together, in one `jobs_finish`, as a
             worker finishes its batch (fewer commits under load; at one call, no wait). Through
             an outage it is retried while the leases may still hold; after that it would be
             refused anyway, and recovery takes the jobs back.
  breaker    each batch's dispatch ends are told to the executors' breakers, as the worker does.
"""

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from typing import Any

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection

from scheduler.connections import database_outage, database_thread, db
from scheduler.metrics import CLAIM_SECONDS
from scheduler.notify import broadcast
from scheduler.notify.feed import Delta, JobFeed
from scheduler.services.claim import Claim, job_claim
from scheduler.services.finish import FinishReport, Outcome
from scheduler.worker.dispatch import model_call_outcome
from scheduler.worker.flight import Flight
from scheduler.worker.host import FlightHost
from scheduler.worker.traces import claims_traced
from telemachus import tracing
from telemachus.control import notify

log = logging.getLogger("telemachus.gateway")


def enabled() -> bool:
    return bool(settings.TELEMACHUS_GATEWAY_ONE_HOP)


@dataclass
class Call(Flight):
    """A call this process claimed and runs. `result` and `cost` are set when its finish was
    accepted with a result: the call answers from them, without reading the job."""

    settled: bool = False  # its run is over, however it ended
    result: dict[str, Any] | None = None
    cost: Decimal | None = None
    # Seconds its model call took (the outcome's `seconds`), for X-Telemachus-Overhead-Ms.
    seconds: float | None = None

    @property
    def answered(self) -> bool:
        return self.cost is not None


class OwnCalls(FlightHost[Call]):
    """The calls one API process (one event loop) claims and runs itself: a worker's flights, in
    this process (scheduler/worker/host.py). Its writes about them run on the process's shared
    database threads; its finishes wake the workers (this process claims only at submit); its
    heartbeat runs while a call is in flight."""

    log = log
    held_db = staticmethod(db)
    _instances: dict[asyncio.AbstractEventLoop, "OwnCalls"] = {}

    def __init__(self) -> None:
        super().__init__(name=f"api:{socket.gethostname()}:{os.getpid()}")
        # Past the lease the finish would be refused anyway: recovery takes the jobs back.
        self.finish_patience = self.lease_seconds
        self._wanted: dict[int, asyncio.Future[Call | None]] = {}
        self._claimer: asyncio.Task[None] | None = None
        self._beat_task: asyncio.Task[None] | None = None
        self._claim_thread = database_thread("telemachus-api-claim")

    @classmethod
    def current(cls) -> "OwnCalls":
        loop = asyncio.get_running_loop()
        calls = cls._instances.get(loop)
        if calls is None:
            cls._instances = {lp: c for lp, c in cls._instances.items() if not lp.is_closed()}
            calls = cls._instances[loop] = cls()
        return calls

    # --- claiming -------------------------------------------------------------------------------

    async def claim(self, job_id: int) -> Call | None:
        """Claim the just-submitted job, if the claim would take it now; start running it. None:
        it stays queued (the workers were woken for it)."""
        future: asyncio.Future[Call | None] = asyncio.get_running_loop().create_future()
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
                    began_ns = time.time_ns() if tracing.active else 0
                    started = time.perf_counter()
                    batch = await asyncio.get_running_loop().run_in_executor(
                        self._claim_thread,
                        partial(_claim_call, worker=self.name, only=frozenset(wanted), limit=len(wanted)),
                    )
                    CLAIM_SECONDS.observe(time.perf_counter() - started)
                if tracing.active and batch.claims:
                    claims_traced(batch.claims, worker=self.name, began_ns=began_ns, ended_ns=time.time_ns())
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
                call = self._start(claim) if claim is not None else None
                if not future.done():
                    future.set_result(call)

    # --- running --------------------------------------------------------------------------------

    def _start(self, claim: Claim) -> Call:
        job = claim.job
        log.info("job %d claimed in process: %s on %s (attempt %d)", job.pk, job.type, claim.executor, job.attempts)
        call = self.fly(Call(claim=claim), self._dispatch)
        if self._beat_task is None or self._beat_task.done():
            self._beat_task = asyncio.create_task(self.heartbeat(), name="onehop-heartbeat")
        return call

    async def _dispatch(self, call: Call) -> Outcome:
        """The model call, as a worker dispatches it; a streamed call's output goes straight to
        its relay in this process (`LocalDeltas`), and to other processes as a worker's does."""
        claim, job = call.claim, call.claim.job
        assert call.driver is not None  # a /v1/ call is a model call: it holds a slot
        sink = LocalDeltas(job.pk, attempt=job.attempts) if job.input.get("stream") else None
        outcome, call.executor_fault = await model_call_outcome(
            driver=call.driver,
            claim=claim,
            on_delta=sink,
            on_step=partial(self.step_record, call),
            started=call.started,
        )
        if sink is not None:
            await sink.flush()
        return outcome

    def finished(self, batch: list[tuple[Call, Outcome]], report: FinishReport | None) -> None:
        """The finish is written (or refused): the calls may answer from it, without a read."""
        for call, outcome in batch:
            if report is not None and outcome.ok and call.job_id in report.accepted:
                call.result, call.cost = outcome.result, report.costs.get(call.job_id, Decimal(0))
                call.seconds = outcome.meta.get("seconds")
            elif report is not None and call.job_id in report.refused:
                log.warning("job %d: result refused (lease no longer held); dropped", call.job_id)
            self._leave(call)

    def aborted(self, call: Call) -> None:
        self._leave(call)

    def _leave(self, call: Call) -> None:
        """The call's run is over: its watches learn it now, not when the database's notification
        comes back."""
        self.flights.pop(call.job_id, None)
        call.settled = True
        JobFeed.current().ended_here(call.job_id)

    def beating(self) -> bool:
        """The heartbeat runs while calls are in flight (the next claim starts it again)."""
        return bool(self.flights)


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


def _wake_workers() -> None:
    notify.notify_workers(notify.QUEUED)
