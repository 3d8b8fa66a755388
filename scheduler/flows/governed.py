"""`governed_slot`: one governed model call for app code that runs its own agent loop in Django.

    from scheduler.flows.governed import governed_slot

    with governed_slot(user=request.user, team="demo", model="llama3", est_tokens=800) as slot:
        reply = httpx.post(f"{slot.endpoint}/chat/completions", json={"model": slot.model, "messages": msgs},
                           headers=slot.headers()).json()
        slot.report(prompt_tokens=reply["usage"]["prompt_tokens"],
                    completion_tokens=reply["usage"]["completion_tokens"])

    async with governed_slot(user=user, team="demo", model="llama3") as slot:   # the async twin
        ...

Entering submits a job of type `governed` (the principal needs `flows:run`, budgets are checked as
at any submit) and waits in the queue like a flow's round: the claim of a running worker takes it
in its turn (priority, fair share, the four caps, budgets, placement) and leaves it to the app,
which then holds the slot, and its lease, and heartbeats it from a thread of its own. The slot
says which executor was chosen: its `endpoint`, `model`, `executor` name and `kind`. Leaving the
block ends the round (scheduler/services/rounds.py: `round_finish`): the slot is freed and the
tokens the caller reported are billed to the usage ledger and fair share; an exception inside the
block fails the job with it (tokens still billed) and propagates.

If the app dies holding the slot, its lease runs out and recovery fails the job (no worker could
run it). If the job is canceled (an operator, the dashboard) the slot's `lost` is set; leaving the
block then raises LeaseLost, unless the block raised already. `timeout` bounds the wait in the
queue: past it, the job is canceled and TimeoutError raised. A running worker is needed, as for
any queued work. Both wait on a job feed (scheduler/notify/feed.py: the job's notification, heard
through one listener) and read the job only when it changed, or WAKE_MAX seconds passed: the async
twin on its event loop's feed, the sync one on the feed of an event loop run in a daemon thread
while any sync wait of the process is under way (`_SyncFeed`), so sync waits share its listener.
"""

import asyncio
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.models import User
from django.db import DatabaseError, connection

from executors.credentials import transport_headers
from executors.models import Executor
from scheduler.models import Job
from scheduler.notify.feed import JobFeed, Watch
from scheduler.services.cancel import job_cancel
from scheduler.services.lease import leases_renew
from scheduler.services.rounds import LeaseLost, round_begin, round_finish
from scheduler.services.submit import job_submit
from telemachus.errors import Conflict

# A wait reads the job when the feed says it changed, and at least this often besides.
WAKE_MAX = 5.0
T = TypeVar("T")


@dataclass
class GovernedSlot:
    """A slot granted to app code: where to send its model call, and what it used."""

    job_id: int
    lease: uuid.UUID
    executor: str
    kind: str
    endpoint: str | None
    model: str
    transport: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    lost: threading.Event = field(default_factory=threading.Event)

    def report(self, *, tokens: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Add tokens used inside the block (call it once per model call, or once at the end);
        `tokens` counts as completion tokens when the split is not known."""
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens + tokens

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def headers(self) -> dict[str, str]:
        """The executor's credentials as headers (its API key as `Authorization: Bearer`, its
        other headers: executors/credentials.py), unsealed or read from this process's
        environment; empty when it has none. Raises SecretUnavailable for one this process
        cannot produce (its variable unset here, no key to unseal it)."""
        return transport_headers(self.transport, executor=self.executor)


class governed_slot:
    """Wait in the queue for a slot on an executor offering `model`, hold it for the block, and
    bill what the caller reports; a context manager for `with` and `async with` alike (named like
    a function, as it is used). See the module docstring."""

    def __init__(
        self,
        *,
        user: User,
        team: str,
        model: str,
        est_tokens: int | None = None,
        priority: int = 0,
        timeout: float | None = None,
        requirements: dict[str, Any] | None = None,
    ) -> None:
        self.user, self.team, self.priority, self.timeout = user, team, priority, timeout
        # Without est_tokens the submit estimates the slot's model call (scheduler/core/estimates.py).
        given = {"est_tokens": est_tokens} if est_tokens is not None else {}
        self.requirements = {**(requirements or {}), "model": model, **given}
        self.job_id: int | None = None
        self.slot: GovernedSlot | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # --- sync ---------------------------------------------------------------------------------

    def __enter__(self) -> GovernedSlot:
        _sync_feed.enter()
        watch: Watch | None = None
        try:
            mark = _sync_feed.run(_feed_mark())
            self.job_id = self._submit()
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            watch = _sync_feed.run(_feed_watch(self.job_id, mark))
            while (slot := self._granted()) is None:
                left = WAKE_MAX if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no slot for job {self.job_id} within {self.timeout}s")
                _sync_feed.run(_watch_changed(watch, min(left, WAKE_MAX)))
        except BaseException:
            self._withdraw()
            raise
        finally:
            if watch is not None:
                _sync_feed.run(_watch_close(watch))
            _sync_feed.leave()
        return self._hold(slot)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._release(exc)

    # --- async --------------------------------------------------------------------------------

    async def __aenter__(self) -> GovernedSlot:
        # The process's job feed (one listener per event loop: scheduler/notify/listener.py) says
        # when the job changes, so the wait reads the job only when a claim may have taken it.
        feed = JobFeed.current()
        mark = feed.mark()
        self.job_id = await sync_to_async(self._submit)()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        try:
            with feed.watch(self.job_id, since=mark) as watch:
                while True:
                    watch.take()
                    if (slot := await sync_to_async(self._granted)()) is not None:
                        break
                    left = WAKE_MAX if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no slot for job {self.job_id} within {self.timeout}s")
                    await watch.wait(min(left, WAKE_MAX))
        except BaseException:
            await sync_to_async(self._withdraw)()
            raise
        return await sync_to_async(self._hold)(slot)

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await sync_to_async(self._release)(exc)

    # --- steps --------------------------------------------------------------------------------

    def _submit(self) -> int:
        job = job_submit(
            user=self.user,
            team=self.team,
            type=Job.Type.GOVERNED,
            requirements=self.requirements,
            input={},
            priority=self.priority,
        )
        return job.pk

    def _granted(self) -> GovernedSlot | None:
        """The slot, once a claim has taken the job; None while it waits. Raises Conflict when the
        job ended before it was granted (canceled, failed)."""
        assert self.job_id is not None, "granted before submitted"
        row = Job.objects.filter(pk=self.job_id).values("status", "lease", "model", "executor_id").first()
        if row is None or row["status"] in Job.TERMINAL:
            raise Conflict(f"Job {self.job_id} ended ({row and row['status']}) before a slot was granted.")
        if row["status"] != Job.Status.RUNNING or row["lease"] is None:
            return None
        executor = Executor.objects.get(pk=row["executor_id"])
        return GovernedSlot(
            job_id=self.job_id,
            lease=row["lease"],
            executor=executor.name,
            kind=executor.kind,
            endpoint=executor.endpoint,
            model=row["model"],
            transport=dict(executor.transport or {}),
        )

    def _hold(self, slot: GovernedSlot) -> GovernedSlot:
        """Take the lease over from the claim: start heartbeating it, and record the round."""
        self.slot = slot
        self._heartbeat = threading.Thread(target=self._beat, name=f"governed-slot-{slot.job_id}", daemon=True)
        self._heartbeat.start()
        try:
            round_begin(job_id=slot.job_id, lease=slot.lease)
        except LeaseLost:
            slot.lost.set()
        return slot

    def _beat(self) -> None:
        """Renew the lease every third of its length until the block ends or it is lost."""
        assert self.slot is not None
        interval = settings.TELEMACHUS_LEASE_SECONDS / 3
        try:
            while not self._stop.wait(interval):
                try:
                    if self.slot.job_id not in leases_renew(held={self.slot.job_id: self.slot.lease}):
                        self.slot.lost.set()
                        return
                except DatabaseError:
                    continue  # the lease outlives a short outage; a long one loses it
        finally:
            connection.close()

    def _release(self, exc: BaseException | None) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        slot = self.slot
        assert slot is not None
        error = f"{type(exc).__name__}: {exc}"[:2000] if exc is not None else ""
        try:
            round_finish(
                job_id=slot.job_id,
                lease=slot.lease,
                round=1,
                prompt_tokens=slot.prompt_tokens,
                completion_tokens=slot.completion_tokens,
                error=error,
            )
        except LeaseLost:
            slot.lost.set()
            if exc is None:
                raise

    def _withdraw(self) -> None:
        """Leave the queue (a timeout, or the caller interrupted): cancel the job unless it ended."""
        if self.job_id is None:  # interrupted before its job was submitted
            return
        try:
            job_cancel(job_id=self.job_id, reason="withdrawn before its slot was used", bill=False)
        except Conflict:
            pass


# --- the sync waiters' job feed ----------------------------------------------------------------


class _SyncFeed:
    """An event loop in a daemon thread, for the sync waits of the process: its job feed, and the
    feed's one listener, serve every sync `governed_slot` waiting at the time. It starts with the
    first wait and stops (its listener's connection closed) when the last one ends, so a process
    that waited once holds no connection for it afterwards."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def enter(self) -> asyncio.AbstractEventLoop:
        with self.lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                self.thread = threading.Thread(target=self.loop.run_forever, name="governed-slot-feed", daemon=True)
                self.thread.start()
            self.waiting += 1
            return self.loop

    def leave(self) -> None:
        with self.lock:
            self.waiting -= 1
            if self.waiting or self.loop is None or self.thread is None:
                return
            loop, thread, self.loop, self.thread = self.loop, self.thread, None, None
            asyncio.run_coroutine_threadsafe(_tasks_cancel(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    def run(self, step: Coroutine[Any, Any, T]) -> T:
        """Run `step` on the loop and wait for its result (the calling thread blocks)."""
        assert self.loop is not None, "run outside enter/leave"
        return asyncio.run_coroutine_threadsafe(step, self.loop).result()


_sync_feed = _SyncFeed()


async def _tasks_cancel() -> None:
    """Cancel the loop's other tasks (the listener's, the feed's) and wait until they end."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _feed_mark() -> tuple[int, int] | None:
    return JobFeed.current().mark()


async def _feed_watch(job_id: int, mark: tuple[int, int] | None) -> Watch:
    """A watch on the job, taken: the caller reads the job next, so a change from here on wakes it."""
    watch = JobFeed.current().watch(job_id, since=mark)
    watch.take()
    return watch


async def _watch_changed(watch: Watch, timeout: float) -> None:
    """Sleep until the watched job changed or `timeout` passed, and take the change."""
    await watch.wait(timeout)
    watch.take()


async def _watch_close(watch: Watch) -> None:
    watch.close()
