"""What an API process hears about jobs, shared by every request it serves.

A request that waits for a job (`/wait/`, `/stream/`, `/v1/chat/completions`) takes a `Watch` on
it and sleeps until the feed says the job changed or output arrived; then it reads the job again.
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
from dataclasses import dataclass, field
from typing import Any

from channels.layers import get_channel_layer
from django.db import connection
from django.db.models import Max

from scheduler.gateway.database import db
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


@dataclass
class ToolCall:
    """A tool call as a relay has heard it: its arguments so far, and whether a gap was seen."""

    id: str = ""
    name: str = ""
    arguments: str = ""
    gap: bool = False


@dataclass(frozen=True)
class ToolPiece:
    """New arguments of tool call `index`, in order; `first` the first piece relayed of it (its id
    and name known from then on)."""

    index: int
    id: str
    name: str
    text: str
    first: bool


class Relay:
    """A job's output as relayed so far, kept in step with the deltas heard. Each delta says where
    it starts, so a repeated one is dropped and a missed one shows as a gap; a delta of a later
    attempt shows that the model's stream broke off and the job was retried.

    An `exact` relay (the model APIs' streams) must add up to the answer: after a gap it relays
    nothing more (the rest comes from the job's result, `rest()`), and a retry after text or a
    tool call went out leaves it `broken`, since it cannot take back what it sent. It follows the
    tool calls' pieces too, each call on its own (`take_tools()`). A loose one (the job stream, whose deltas
    carry offsets and attempts) may start where it joined and starts over with each attempt."""

    def __init__(self, *, exact: bool) -> None:
        self.exact = exact
        self.base = 0  # where the relayed text starts in the attempt's output
        self.sent = ""
        self.attempt: int | None = None
        self.gap = False
        self.broken = False
        self.tools: dict[int, ToolCall] = {}  # an exact relay's tool calls, by index
        self._tool_pieces: list[ToolPiece] = []

    def accept(self, deltas: list[Delta]) -> list[Delta]:
        """The new, in-order pieces of the reply's text among `deltas`. An exact relay keeps the
        tool calls' pieces for `take_tools()`; a loose one ignores them."""
        fresh = []
        for delta in deltas:
            if delta.part and not self.exact:
                continue
            if self.attempt is None or (
                delta.attempt > self.attempt and not (self.exact and (self.sent or self._relayed_tools()))
            ):
                self.attempt, self.sent, self.gap, self.tools = delta.attempt, "", False, {}
                self.base = 0 if self.exact else delta.offset
            if delta.attempt > self.attempt:
                self.broken = True
            if delta.attempt != self.attempt or self.broken:
                continue
            if delta.part:
                self._accept_tool(delta)
                continue
            if self.gap:
                continue
            have = self.base + len(self.sent)
            if delta.offset > have:
                self.gap = True
            elif delta.offset + len(delta.text) > have:
                text = delta.text[have - delta.offset :]
                fresh.append(Delta(delta.attempt, have, text))
                self.sent += text
        return fresh

    def _accept_tool(self, delta: Delta) -> None:
        """A tool call's piece: relayed once the call's id and name are known, in order; after a
        gap nothing more of that call (the rest comes from the job's result)."""
        index = int(delta.part.removeprefix("tool:") or 0)
        call = self.tools.setdefault(index, ToolCall())
        if call.gap:
            return
        if delta.offset > len(call.arguments):
            call.gap = True
            return
        announced = bool(call.id and call.name)
        call.id, call.name = call.id or delta.id, call.name or delta.name
        new = delta.text[len(call.arguments) - delta.offset :]
        call.arguments += new
        if not announced and call.id and call.name:
            self._tool_pieces.append(ToolPiece(index, call.id, call.name, call.arguments, first=True))
        elif announced and new:
            self._tool_pieces.append(ToolPiece(index, call.id, call.name, new, first=False))

    def _relayed_tools(self) -> bool:
        return any(call.id and call.name for call in self.tools.values())

    def take_tools(self) -> list[ToolPiece]:
        """The tool calls' pieces accepted since the last take, in the order they came."""
        pieces, self._tool_pieces = self._tool_pieces, []
        return pieces

    def rest(self, result: dict[str, Any] | None) -> str | None:
        """What remains to relay of the final text, or None if it does not continue what was sent."""
        full = str(((result or {}).get("message") or {}).get("content") or "")[self.base :]
        return full[len(self.sent) :] if full.startswith(self.sent) else None


@dataclass
class RoundPart:
    """What a flow's job stream has sent of one part of a round's output (its text, or a tool
    call's arguments): how much, the call's id and name, and whether a piece was missed."""

    sent: int = 0
    id: str = ""
    name: str = ""
    gap: bool = False


@dataclass
class RoundOutput:
    """The attempt of an unfinished round that a flow's job stream follows, and its parts."""

    attempt: int
    parts: dict[str, RoundPart] = field(default_factory=dict)


class RoundRelay:
    """The job stream's relay of a streamed flow (scheduler/gateway/jobs.py): each round's pieces,
    tagged with the round, in order and each once.

    The rounds before `closed + 1` the client has whole: a round's `round_finished` event goes out
    after the rest of its output, completed from its recorded answer (`close`), so a piece that
    was missed (the stream joined mid-round, a delta lost) comes then, never out of order. A
    later attempt of the open round (a retry, or the round run again after its worker died)
    starts that round over, as a chat's next attempt does. A delta of a round after the open one
    means the open one ended (`behind`): the stream reads the job and closes it first.

    Where the client is (`cursor`) is the SSE id of everything the stream sends for a flow, so a
    client that reconnects with `Last-Event-ID` gets neither a piece twice nor a gap (`resume`)."""

    def __init__(self, *, closed: int = 0, open: dict[int, RoundOutput] | None = None) -> None:
        self.closed = closed
        self.open: dict[int, RoundOutput] = open or {}

    @classmethod
    def resume(cls, last_event_id: str) -> "tuple[int, RoundRelay | None]":
        """The last event id in a cursor, and the relay it describes (None: a plain event id, so
        the rounds it has whole are those whose `round_finished` it has). ValueError if malformed."""
        head, *rest = last_event_id.split(".")
        if not rest:
            return int(head), None
        round_no, attempt, *lengths = (int(n) for n in rest)
        parts = {"": RoundPart(sent=lengths[0])} if lengths else {}
        parts.update({broadcast.tool_part(i): RoundPart(sent=n) for i, n in enumerate(lengths[1:])})
        return int(head), cls(closed=round_no - 1, open={round_no: RoundOutput(attempt, parts)})

    def cursor(self, event_id: int) -> str:
        """Where the client is: the last event sent, then the open round's round, attempt, and how
        much of its text and of each tool call's arguments went out."""
        output = self.open.get(self.closed + 1)
        if output is None:
            return str(event_id)
        tools = [int(part.removeprefix("tool:")) for part in output.parts if part]
        lengths = [
            output.parts.get(p, RoundPart()).sent
            for p in ["", *map(broadcast.tool_part, range(max(tools, default=-1) + 1))]
        ]
        return ".".join(str(n) for n in [event_id, self.closed + 1, output.attempt, *lengths])

    def behind(self, deltas: list[Delta]) -> bool:
        """Whether a delta is of a round past the open one: that one has ended, close it first."""
        return any(delta.round > self.closed + 1 for delta in deltas)

    def accept(self, deltas: list[Delta], event_id: int) -> list[tuple[Delta, str]]:
        """The new, in-order pieces of the open round among `deltas`, each with the cursor after it."""
        fresh = []
        for delta in deltas:
            if delta.round != self.closed + 1:  # a closed round's late piece (its close sent it)
                continue
            output = self.open.get(delta.round)
            if output is None or delta.attempt > output.attempt:
                output = self.open[delta.round] = RoundOutput(delta.attempt)
            elif delta.attempt < output.attempt:
                continue
            part = output.parts.setdefault(delta.part, RoundPart())
            part.id, part.name = part.id or delta.id, part.name or delta.name
            if part.gap or delta.offset > part.sent:
                part.gap = True  # the rest comes with the round's end
                continue
            text = delta.text[part.sent - delta.offset :]
            if text:
                fresh.append((self._sent(delta.round, output, delta.part, part, text), self.cursor(event_id)))
        return fresh

    def close(
        self, round_no: int, attempt: int | None, answer: dict[str, Any] | None, event_id: int
    ) -> list[tuple[Delta, str]]:
        """Round `round_no` ended with `answer` (by its attempt `attempt`): what the client has not
        had of it, each with the cursor after it (the round still open until this returns)."""
        if round_no <= self.closed:
            return []
        output = self.open.get(round_no)
        if output is None or (attempt is not None and attempt != output.attempt):
            # The recorded answer is of an attempt not followed here: it starts the round over.
            output = self.open[round_no] = RoundOutput(attempt if attempt is not None else 1)
        self.closed = round_no - 1  # rounds end in order: this one is the open one its cursors name
        fresh = []
        answer = answer or {}
        wholes = [("", "", "", str(answer.get("content") or ""))]
        for index, call in enumerate(answer.get("tool_calls") or ()):
            function = call.get("function") or {}
            wholes.append(
                (
                    broadcast.tool_part(index),
                    str(call.get("id") or ""),
                    str(function.get("name") or ""),
                    str(function.get("arguments") or ""),
                )
            )
        for part_name, ident, name, whole in wholes:
            part = output.parts.setdefault(part_name, RoundPart())
            part.id, part.name = ident or part.id, name or part.name
            if whole[part.sent :]:
                fresh.append((self._sent(round_no, output, part_name, part, whole[part.sent :]), self.cursor(event_id)))
        del self.open[round_no]
        self.closed = round_no
        return fresh

    @staticmethod
    def _sent(round_no: int, output: RoundOutput, part_name: str, part: RoundPart, text: str) -> Delta:
        delta = Delta(output.attempt, part.sent, text, part_name, part.id, part.name, round_no)
        part.sent += len(text)
        return delta


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
        """A job this process ran itself has ended (scheduler/gateway/onehop.py): its watches
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


def _job_states(*, job_ids: list[int]) -> dict[int, tuple[str, int | None]]:
    """Status and latest event id of each job: what a watcher would see change."""
    rows = (
        Job.objects.filter(pk__in=job_ids)
        .annotate(last_event=Max("events__id"))
        .values_list("pk", "status", "last_event")
    )
    return {pk: (status, last_event) for pk, status, last_event in rows}
