"""The worker's claim loop, and what wakes it.

It claims as many jobs as the worker has free local slots (`job_claim`, on the claim thread, under
the breaker gate), starts them, then waits to be woken: by NOTIFY on PostgreSQL (work queued,
capacity freed, configuration changed, a job canceled), by the worker's own finishes, or on SQLite
by a watch on its data_version (another connection committed), both heard through the process's
listener (scheduler/notify/listener.py); and, when the claim said something waits on time (a
retry's backoff, a breaker's cooldown, a budget window), at that moment. The timer (`idle_poll`,
or backing off from `poll_min` to `poll_max` while nothing is heard) is a safety net for a bug in
the wake-ups, not how work flows."""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sized
from typing import Any, Protocol, TypeVar

from django.db import DatabaseError, connection

from scheduler.metrics import CLAIM_SECONDS
from scheduler.notify.listener import Listener, Subscription
from scheduler.services.claim import Claim, job_claim
from scheduler.worker.traces import claims_traced
from telemachus import tracing
from telemachus.control import notify

log = logging.getLogger("telemachus.worker")
T = TypeVar("T")
SQLITE_WATCH_SECONDS = 0.01
# Wake this much after a time-bound moment the claim named, so the database's clock has passed it.
TIME_WAKE_MARGIN = 0.005


class Claimer(Protocol):
    """What the claim loop needs of its worker (scheduler/worker/runner.py)."""

    name: str
    concurrency: int
    burst: bool
    stopping: bool
    breaker_gate: asyncio.Lock

    @property
    def flights(self) -> Sized: ...

    def db(self, fn: Callable[..., T], /, **kwargs: Any) -> Awaitable[T]: ...

    def start(self, claim: Claim) -> None: ...

    def abort(self, job_id: int, reason: str) -> None: ...


class ClaimLoop:
    def __init__(self, worker: Claimer, *, poll_min: float, poll_max: float, idle_poll: float) -> None:
        self.worker = worker
        self.poll_min, self.poll_max = poll_min, poll_max
        self.idle_poll = idle_poll
        self.wake = asyncio.Event()
        self.want_freed = True  # wake when capacity frees: work may be waiting for it
        self.freed = 0  # capacity-freed wake-ups so far (own finishes, `freed` notifications)
        self._ears: Subscription | None = None  # the process's listener, while running

    async def run(self) -> None:
        """Claim until the worker stops (or, in burst mode, until nothing is left to do)."""
        self._ears = Listener.current().subscribe(
            self, channels=[notify.WORKERS_CHANNEL], sqlite_interval=SQLITE_WATCH_SECONDS
        )
        worker, idle = self.worker, self.poll_min
        while not worker.stopping:
            free = worker.concurrency - len(worker.flights)
            wake_in = None
            if free > 0:
                freed = self.freed
                try:
                    async with worker.breaker_gate:
                        began_ns = time.time_ns() if tracing.active else 0
                        started = time.perf_counter()
                        batch = await worker.db(job_claim, worker=worker.name, limit=free)
                        CLAIM_SECONDS.observe(time.perf_counter() - started)
                    if tracing.active and batch.claims:
                        claims_traced(batch.claims, worker=worker.name, began_ns=began_ns, ended_ns=time.time_ns())
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
                    worker.start(claim)
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
            if worker.burst and not worker.flights:
                log.info("worker %s: queue drained (burst mode)", worker.name)
                return
            await self._wait_for_wake(idle, wake_in)
            idle = min(idle * 2, self.poll_max)

    async def aclose(self) -> None:
        if self._ears is not None:
            await self._ears.aclose()

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

    def capacity_freed(self) -> None:
        self.freed += 1
        if self.want_freed or self.worker.stopping:
            self.wake.set()

    # --- the listener's subscriber (scheduler/notify/listener.py) -------------------------------------

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
            self.capacity_freed()
        elif payload.startswith(f"{notify.CANCELED}:"):
            self.worker.abort(int(payload.partition(":")[2]), "canceled")

    def missed(self) -> None:
        """Listening again (or, on SQLite, another connection committed): anything may be waiting."""
        self.wake.set()

    def live_changed(self, live: bool) -> None:
        """Nothing to do: the claim loop and the heartbeat read `listening` each time round."""
