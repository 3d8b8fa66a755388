"""The scheduler worker: claims jobs, dispatches them to executors, heartbeats, finishes, recovers.

One asyncio loop keeps up to `concurrency` dispatches in flight (model calls are network I/O, so
hundreds are cheap). Database calls run in short transactions on dedicated threads, never while
a model call is awaited: claim, run, finish are separate steps. On PostgreSQL, claims (and
recovery and probes) take one thread and connection; the writes of the jobs this worker holds
(finishes, heartbeats, releases) another, so a finish never waits behind a claim (finishes do not
take the claim lock, so the two overlap in the database too). SQLite serializes writers, so there
a second connection would only wait for the first: everything shares one thread.

  claim loop   claims as many jobs as there are free local slots, then waits to be woken
               (scheduler/worker/claims.py).
  dispatches   one task per job; the driver's dispatch() runs outside any transaction. A flow's
               claim is one round (scheduler/flows/runner.py): model call, slot freed, tools in the
               tool threads, next round queued; a tool job runs in the tool threads; a governed
               slot is its app's to run (scheduler/flows/governed.py). scheduler/worker/dispatch.py.
  finisher     writes results in batches (the finish is fenced by each job's lease), and tells the
               breakers; flows' rounds that end with their quick tools are batched likewise
               (scheduler/worker/host.py, scheduler/worker/rounds.py).
  heartbeat    renews leases; a lease that is not renewed is lost and its dispatch is aborted,
               including when the database cannot be reached for longer than the lease
               (scheduler/worker/host.py).
  recovery, probes, history, webhooks, retention   beside the jobs (scheduler/worker/upkeep.py).

First SIGTERM/SIGINT: stop claiming, let in-flight work finish, exit. A second signal (or the
grace period running out): abort the dispatches and give their jobs back to the queue.
"""

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.conf import settings
from django.db import connection

from scheduler.connections import database_call, database_thread, database_thread_close
from scheduler.metrics import worker_heartbeat_forget, worker_heartbeat_observe
from scheduler.models import Job
from scheduler.services.claim import Claim
from scheduler.services.finish import FinishReport, Outcome
from scheduler.services.lease import jobs_release
from scheduler.services.rounds import RoundOutcome
from scheduler.worker import upkeep
from scheduler.worker.claims import ClaimLoop
from scheduler.worker.dispatch import flight_dispatch
from scheduler.worker.flight import Flight
from scheduler.worker.host import FlightHost
from scheduler.worker.probes import heartbeat_check, probe_serve
from scheduler.worker.rounds import RoundEnder

log = logging.getLogger("telemachus.worker")
T = TypeVar("T")


# Dispatches in flight per worker. Model calls wait on the network, so a worker holds many cheaply
# (about 31 KiB each, bench/dispatch.py); the caps, not this, protect the model servers. It is also
# the most jobs one claim can take, and a claim's fixed cost (lock, state, queue lookups) is
# shared by the jobs it takes: 64 drains no-op jobs about twice as fast as 16 (bench/throughput.py).
DEFAULT_CONCURRENCY = 64
# The longest a waiting worker sleeps with nothing waking it. Notifications, its own finishes and
# the claim's `wake_in` do the waking; this is a safety net for a bug in them, not how work flows.
DEFAULT_IDLE_POLL = 2.0


class Worker(FlightHost[Flight]):
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
        super().__init__(name=name)
        self.concurrency = concurrency
        self.burst = burst
        self.grace = grace
        self.claims = ClaimLoop(self, poll_min=poll_min, poll_max=poll_max, idle_poll=idle_poll)
        self.rounds = RoundEnder(self)
        self.to_release: dict[int, uuid.UUID] = {}
        self.stopping = False
        self.forced = False
        self._claim_thread = database_thread("telemachus-claim")
        self._finish_thread = (
            database_thread("telemachus-finish") if connection.vendor == "postgresql" else self._claim_thread
        )
        # Tools (a flow's calls between rounds, tool jobs) run here: never on the event loop, the
        # database threads or a model slot.
        self.tool_threads: futures.Executor = ThreadPoolExecutor(
            max_workers=settings.TELEMACHUS_TOOL_THREADS, thread_name_prefix="telemachus-tool"
        )
        self.processed = 0
        self.beat_at = time.monotonic()

    # --- database calls, on two threads -------------------------------------------------------------

    async def db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Claims, recovery, probes."""
        return await database_call(self._claim_thread, fn, **kwargs)

    async def held_db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Writes about the jobs this worker holds: finishes, heartbeats, releases."""
        return await database_call(self._finish_thread, fn, **kwargs)

    # --- lifecycle ----------------------------------------------------------------------------------

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
        await upkeep.recover_once(db=self.db, recovered=self.claims.wake.set)
        background = [
            asyncio.create_task(self.rounds.run(), name="round-ender"),
            asyncio.create_task(self.heartbeat(), name="heartbeat"),
            asyncio.create_task(
                upkeep.recovery(db=self.db, lease_seconds=self.lease_seconds, recovered=self.claims.wake.set),
                name="recovery",
            ),
            asyncio.create_task(upkeep.probes(db=self.db, drivers=self.drivers), name="probes"),
            asyncio.create_task(upkeep.history(db=self.db), name="history"),
            asyncio.create_task(upkeep.webhooks(), name="webhooks"),
            asyncio.create_task(upkeep.retention(), name="retention"),
            asyncio.create_task(upkeep.batches(), name="batches"),
        ]
        probes = (
            await probe_serve(db=self.db, heartbeat=self._heartbeat_state) if settings.TELEMACHUS_METRICS_BIND else None
        )
        try:
            await self.claims.run()
            await self._drain()
        finally:
            if probes is not None:
                probes.close()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.claims.aclose()
            for driver in self.drivers.all():
                await driver.aclose()
            for thread in {self._claim_thread, self._finish_thread}:
                await database_thread_close(thread)
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
                "worker %s stopping: draining %d in flight (signal again to abort them)", self.name, len(self.flights)
            )
            if self.grace is not None:
                asyncio.get_running_loop().call_later(self.grace, self.force_stop)
        else:
            self.force_stop()
        self.claims.wake.set()

    def force_stop(self) -> None:
        if self.forced:
            return
        self.forced = True
        log.info("worker %s aborting %d in flight; their jobs go back to the queue", self.name, len(self.flights))
        for job_id in list(self.flights):
            self.abort(job_id, "shutdown")

    async def _drain(self) -> None:
        while self.flights:
            await asyncio.sleep(0.02)
        if self.to_release:
            released = await self.db_retrying(
                jobs_release, held=self.to_release, reason=f"worker {self.name} shut down"
            )
            log.info("released %d job(s) back to the queue: %s", len(released), released)

    # --- flights ------------------------------------------------------------------------------------

    def start(self, claim: Claim) -> None:
        """Run a job the claim loop claimed."""
        job = claim.job
        where = claim.executor.name if claim.executor is not None else "the tool threads"
        log.info("job %d claimed: %s on %s (team %s, attempt %d)", job.pk, job.type, where, job.team_id, job.attempts)
        if job.type == Job.Type.GOVERNED:
            return  # its app holds the lease from here (scheduler/flows/governed.py)
        self.fly(Flight(claim=claim), self._dispatch)

    async def _dispatch(self, flight: Flight) -> Outcome | None:
        return await flight_dispatch(self, flight)

    def aborted(self, flight: Flight) -> None:
        self.flights.pop(flight.job_id, None)
        if flight.abort_reason == "shutdown":
            self.to_release[flight.job_id] = flight.claim.lease
        if flight.abort_reason is not None:
            self.claims.capacity_freed()

    def flight_ended(self, job_id: int, *, queued: bool = False) -> None:
        """A flight that wrote its own end (a flow's round) leaves: its capacity is free. `queued`:
        it queued the flow's next round telling no other worker, so this one claims at once."""
        self.flights.pop(job_id, None)
        self.processed += 1
        self.claims.capacity_freed()
        if queued:
            self.claims.wake.set()

    async def round_end(self, end: RoundOutcome) -> str:
        """A flow's round ended with its quick tools: written in a batch (scheduler/worker/rounds.py)."""
        return await self.rounds.round_end(end)

    # --- finishing ----------------------------------------------------------------------------------

    @property
    def wake_others(self) -> bool:
        """A worker's finishes wake only itself (it has the room to claim what it freed), unless it
        is stopping."""
        return self.stopping

    def finished(self, batch: list[tuple[Flight, Outcome]], report: FinishReport | None) -> None:
        """The batch's results are stored: its jobs leave this worker, which may claim again."""
        refused = set(report.refused) if report is not None else set()
        retrying = set(report.retrying) if report is not None else set()
        for _, outcome in batch:
            self.flights.pop(outcome.job_id, None)
            self.processed += 1
            if report is None:
                continue  # logged by the finisher: left to recovery
            if outcome.job_id in refused:
                log.warning("job %d: result refused (lease no longer held); dropped", outcome.job_id)
            elif outcome.job_id in retrying:
                log.info("job %d failed, will retry: %s", outcome.job_id, outcome.error)
            elif outcome.ok:
                log.info("job %d done (%s tokens)", outcome.job_id, outcome.tokens_used)
            else:
                log.info("job %d failed: %s", outcome.job_id, outcome.error)
        self.claims.capacity_freed()

    # --- heartbeat ----------------------------------------------------------------------------------

    def beat_interval(self) -> float:
        # Without LISTEN, the heartbeat is also how a cancel reaches us: beat faster.
        return self.lease_seconds / 3 if self.claims.listening else min(self.lease_seconds / 3, 1.0)

    def beaten(self) -> None:
        self.beat_at = time.monotonic()
        worker_heartbeat_observe(worker=self.name)

    def _heartbeat_state(self) -> str:
        return heartbeat_check(beat_at=self.beat_at, interval=self.beat_interval())
