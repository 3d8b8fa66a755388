"""What a process hears about jobs, shared by everything in it that waits on one: the API
process's requests (`/wait/`, `/stream/`, `/v1/...`: scheduler/gateway/) and app code's governed
slots (scheduler/flows/governed.py).

A waiter takes a `Watch` on a job and sleeps until the feed says the job changed or output
arrived; then it reads the job again. What a request relays of the output: scheduler/gateway/relay.py.
The feed is one per process (per event loop), never one per request, and hears the database
through the process's listener (scheduler/notify/listener.py):

* job changes: on PostgreSQL, the jobs' channel (telemachus/control/notify.py), where every job
  event sends its job id and event at commit (scheduler/services/events.py). On SQLite, which
  has no NOTIFY and serves one host, the listener's watch on `PRAGMA data_version`, every few
  milliseconds while anything is watched, and on each move one query for the state of every
  watched job. While the PostgreSQL listener is down, the same query runs once a second.
* output deltas of streamed jobs (scheduler/notify/broadcast.py): from the channel layer (one channel for
  the process, added to the group of each job watched for output) or, on PostgreSQL without Redis,
  from the jobs' channel too.

Missing a delta is survivable (a watcher fills the gap from the job's result); missing a change is
not, so every path that could lose one (a listener that reconnects, a watch taken after the change)
marks the watch changed and lets the watcher read the database."""

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from channels.layers import get_channel_layer
from django.db import connection
from django.db.models import Max

from scheduler.connections import db, idempotent
from scheduler.models import Job, JobEvent
from scheduler.notify import broadcast
from scheduler.notify.listener import Listener
from telemachus.control import notify

log = logging.getLogger("telemachus.feed")
SQLITE_WATCH_SECONDS = 0.005
FALLBACK_POLL_SECONDS = 1.0
# Events after which the job is over (its status is terminal).
ENDING_EVENTS = frozenset({JobEvent.Type.FINISHED, JobEvent.Type.FAILED, JobEvent.Type.CANCELED})
# How many recently changed jobs the PostgreSQL listener remembers, for watches taken just after.
RECENT_JOBS = 50_000


@dataclass(frozen=True)
class Delta:
    """A piece of a job's streamed output. `part` "" is the reply's text; `"tool:<index>"` the
    arguments of a tool call, whose `id` and `name` come with each piece (as far as known).
    `round`: a flow's round (its offsets and attempts are the round's), 0 for any other job."""

    attempt: int
    offset: int
    text: str
    part: str = ""
    id: str = ""
    name: str = ""
    round: int = 0


def delta_from(message: dict[str, Any]) -> Delta:
    """A delta as a worker sends it (scheduler/notify/broadcast.py)."""
    return Delta(
        int(message["attempt"]),
        int(message["offset"]),
        str(message["text"]),
        str(message.get("part") or ""),
        str(message.get("id") or ""),
        str(message.get("name") or ""),
        int(message.get("round") or 0),
    )


class Watch:
    """One request's interest in one job. `changed`: the job changed since the last `take()`;
    `maybe_ended`: one of those changes may have ended it (read the job to know); `deltas`: output
    that arrived, oldest first."""

    def __init__(self, feed: "JobFeed", job_id: int, *, deltas: bool) -> None:
        self.feed = feed
        self.job_id = job_id
        self.wants_deltas = deltas
        self.changed = False
        self.maybe_ended = False
        self.deltas: list[Delta] = []
        self._ready = asyncio.Event()

    def notify(self, *, ended: bool) -> None:
        self.changed = True
        self.maybe_ended = self.maybe_ended or ended
        self._ready.set()

    def add_delta(self, delta: Delta) -> None:
        self.deltas.append(delta)
        self._ready.set()

    async def wait(self, timeout: float, *, unless: asyncio.Future[Any] | None = None) -> bool:
        """Sleep until something arrives (True), the timeout passes or `unless` is done (False)."""
        if self._ready.is_set():
            return True
        waiter = asyncio.ensure_future(self._ready.wait())
        waiting = {waiter} if unless is None else {waiter, unless}
        try:
            await asyncio.wait(waiting, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        return self._ready.is_set()

    def take(self) -> tuple[bool, bool, list[Delta]]:
        """(changed, maybe_ended, deltas) since the last take, and reset."""
        taken = (self.changed, self.maybe_ended, self.deltas)
        self.changed, self.maybe_ended, self.deltas = False, False, []
        self._ready.clear()
        return taken

    def close(self) -> None:
        self.feed._drop(self)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class JobFeed:
    _instances: dict[asyncio.AbstractEventLoop, "JobFeed"] = {}

    def __init__(self) -> None:
        self.vendor = connection.vendor
        self.deltas_via = broadcast.delta_transport()
        self.watches: dict[int, set[Watch]] = {}
        # PostgreSQL: job id -> (epoch, event) of the last change heard, for `watch(since=...)`.
        self.recent: OrderedDict[int, tuple[int, str]] = OrderedDict()
        self.epoch = 0
        self.generation = 0  # bumped each time the listener (re)connects
        self._known: dict[int, tuple[str, int | None]] = {}
        self._stale = asyncio.Event()  # SQLite: another connection committed since the last read
        self._poller: asyncio.Task[None] | None = None  # PostgreSQL: reads while the listener is down
        self._group_ops: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self._channel: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # On SQLite, watched only while a request waits (`active`); PostgreSQL listens throughout,
        # so a watch taken after a mark knows what changed in between.
        self._ears = Listener.current().subscribe(
            self, channels=[notify.JOBS_CHANNEL], sqlite_interval=SQLITE_WATCH_SECONDS, active=False
        )

    @property
    def listening(self) -> bool:
        """PostgreSQL: job changes are heard now (connected, the jobs' channel LISTENed)."""
        return self.vendor == "postgresql" and self._ears.live

    @classmethod
    def current(cls) -> "JobFeed":
        """The feed of the running event loop, started on first use."""
        loop = asyncio.get_running_loop()
        feed = cls._instances.get(loop)
        if feed is None:
            cls._instances = {lp: f for lp, f in cls._instances.items() if not lp.is_closed()}
            feed = cls._instances[loop] = cls()
            feed._start()
        return feed

    def _start(self) -> None:
        if self.vendor == "sqlite":
            self._tasks.append(asyncio.create_task(self._refresh_when_stale(), name="feed-sqlite"))
        if self.deltas_via == broadcast.LAYER:
            self._tasks.append(asyncio.create_task(self._receive_deltas(), name="feed-deltas"))

    # --- watches --------------------------------------------------------------------------------

    def mark(self) -> tuple[int, int] | None:
        """Taken before an action (a submit); a watch taken after it `since` this mark is told of
        changes it missed in between, when the feed can know (PostgreSQL, listener up)."""
        return (self.generation, self.epoch) if self.listening else None

    def watch(self, job_id: int, *, deltas: bool = False, since: tuple[int, int] | None = None) -> Watch:
        """A watch on a job. Without a usable `since`, it starts out changed: read the job first."""
        watch = Watch(self, job_id, deltas=deltas)
        first = job_id not in self.watches
        self.watches.setdefault(job_id, set()).add(watch)
        self._ears.active = True
        if (
            deltas
            and self.deltas_via == broadcast.LAYER
            and not any(w.wants_deltas for w in self.watches[job_id] if w is not watch)
        ):
            self._group_ops.put_nowait(("add", job_id))
        if since is None or not self.listening or since[0] != self.generation:
            watch.notify(ended=True)
        elif (heard := self.recent.get(job_id)) is not None and heard[0] > since[1]:
            watch.notify(ended=heard[1] in ENDING_EVENTS)
        if first and self.vendor == "sqlite":
            self._known.pop(job_id, None)
        return watch

    def _drop(self, watch: Watch) -> None:
        watches = self.watches.get(watch.job_id)
        if not watches or watch not in watches:
            return
        watches.discard(watch)
        if watch.wants_deltas and self.deltas_via == broadcast.LAYER and not any(w.wants_deltas for w in watches):
            self._group_ops.put_nowait(("discard", watch.job_id))
        if not watches:
            del self.watches[watch.job_id]
            self._known.pop(watch.job_id, None)
            if not self.watches:
                self._ears.active = False

    def _changed(self, job_id: int, event: str) -> None:
        self.epoch += 1
        self.recent[job_id] = (self.epoch, event)
        self.recent.move_to_end(job_id)
        if len(self.recent) > RECENT_JOBS:
            self.recent.popitem(last=False)
        for watch in self.watches.get(job_id, ()):
            watch.notify(ended=event in ENDING_EVENTS)

    def ended_here(self, job_id: int) -> None:
        """A job this process ran itself has ended (one hop, scheduler/gateway/onehop.py): its watches
        learn it now, not when the database's notification comes back."""
        for watch in self.watches.get(job_id, ()):
            watch.notify(ended=True)

    def delta_here(self, job_id: int, delta: Delta) -> None:
        """Output of a job this process runs itself, to its watches at once."""
        self._delta(job_id, delta)

    def _delta(self, job_id: int, delta: Delta) -> None:
        for watch in self.watches.get(job_id, ()):
            if watch.wants_deltas:
                watch.add_delta(delta)

    def _all_changed(self) -> None:
        for watches in self.watches.values():
            for watch in watches:
                watch.notify(ended=True)

    # --- what the listener tells ------------------------------------------------------------------

    def notified(self, channel: str, payload: str) -> None:
        self._on_notify(payload)

    def missed(self) -> None:
        if self.vendor == "postgresql":
            # Listening again: anything may have happened while we were not.
            self.generation += 1
            self._all_changed()
        else:
            # SQLite: another connection committed; read the watched jobs to see which changed.
            self._stale.set()

    def live_changed(self, live: bool) -> None:
        if self.vendor == "postgresql" and not live and (self._poller is None or self._poller.done()):
            log.warning("job feed: not listening; reading watched jobs each second until the listener is back")
            self._poller = asyncio.create_task(self._poll_while_down(), name="feed-poll")

    async def _poll_while_down(self) -> None:
        while not self.listening:
            if self.watches:
                await self._refresh()
            await asyncio.sleep(FALLBACK_POLL_SECONDS)

    def _on_notify(self, payload: str) -> None:
        try:
            if payload.startswith(notify.CHANGED):
                for item in payload[len(notify.CHANGED) :].split(","):
                    job_id, _, event = item.partition(":")
                    self._changed(int(job_id), event)
            elif payload.startswith(notify.DELTA) and self.deltas_via == broadcast.POSTGRES:
                message = json.loads(payload[len(notify.DELTA) :])
                self._delta(int(message["job"]), delta_from(message))
        except (ValueError, KeyError, TypeError):
            log.warning("job feed: ignored a malformed notification %r", payload[:200])

    # --- SQLite ---------------------------------------------------------------------------------

    async def _refresh_when_stale(self) -> None:
        while True:
            await self._stale.wait()
            self._stale.clear()
            await self._refresh()

    async def _refresh(self) -> None:
        """Read the state of every watched job in one query; tell the watches of those that changed."""
        ids = sorted(self.watches)
        if not ids:
            return
        try:
            states = await db(_job_states, job_ids=ids)
        except Exception as exc:
            log.warning("job feed: could not read watched jobs (%s)", exc)
            return
        for job_id in ids:
            state = states.get(job_id, ("gone", None))
            if self._known.get(job_id) != state and job_id in self.watches:
                self._known[job_id] = state
                for watch in self.watches[job_id]:
                    watch.notify(ended=state[0] in Job.TERMINAL or state[0] == "gone")

    # --- channel layer --------------------------------------------------------------------------

    async def _receive_deltas(self) -> None:
        layer = get_channel_layer()
        if layer is None:
            return
        self._channel = await layer.new_channel()
        groups = asyncio.create_task(self._group_membership(layer), name="feed-groups")
        try:
            while True:
                try:
                    message = await layer.receive(self._channel)
                    self._delta(int(message["job"]), delta_from(message))
                except (KeyError, ValueError, TypeError):
                    log.warning("job feed: ignored a malformed delta")
                except Exception as exc:
                    log.warning("job feed: channel layer receive failed (%s); retrying", exc)
                    await asyncio.sleep(1.0)
        finally:
            groups.cancel()

    async def _group_membership(self, layer: Any) -> None:
        """Group adds and discards, one at a time in the order watches asked for them."""
        while True:
            op, job_id = await self._group_ops.get()
            group = broadcast.job_group(job_id)
            try:
                if op == "add":
                    await layer.group_add(group, self._channel)
                else:
                    await layer.group_discard(group, self._channel)
            except Exception as exc:
                log.warning("job feed: could not %s group %s (%s)", op, group, exc)


@idempotent
def _job_states(*, job_ids: list[int]) -> dict[int, tuple[str, int | None]]:
    """Status and latest event id of each job: what a watcher would see change."""
    rows = (
        Job.objects.filter(pk__in=job_ids)
        .annotate(last_event=Max("events__id"))
        .values_list("pk", "status", "last_event")
    )
    return {pk: (status, last_event) for pk, status, last_event in rows}
