"""One listener per process (per event loop) for everything in it that hears of database changes:
the worker's claim loop (scheduler/worker/claims.py), open dashboards (scheduler/live/consumers.py)
and the job feed (scheduler/notify/feed.py), which the gateway's requests and governed slots wait
on. Channels, payloads and who sends them: telemachus/control/notify.py.

* PostgreSQL: ONE connection (TELEMACHUS_LISTEN_DATABASE_URL if set, else Django's database)
  LISTENs on the union of the channels the subscribers want: LISTEN when a subscriber wants a
  channel nobody heard yet, UNLISTEN when nobody wants it any more, closed when the last
  subscriber leaves. A lost connection is opened again after 0.5 s, doubling up to 10 s.
  Whenever a subscriber starts hearing its channels (the first connect, every reconnect, a LISTEN
  taken for it), it is told it may have missed something (`missed()`): a NOTIFY sent while
  nobody listened is gone.
* SQLite has no NOTIFY. ONE connection watches `PRAGMA data_version` (it moves whenever another
  connection commits; reading it touches no table), at the smallest interval any active
  subscriber asks for, and not at all while none is active. A subscriber is told `missed()` when
  the version moved since it last looked; it looks first when it subscribes, so it misses nothing
  that commits after `subscribe()` returns.

`live` says whether a subscriber hears changes now (PostgreSQL: connected with its channels
LISTENed; SQLite: watched). While it is False a subscriber finds out on its own: the worker by its
timer, a dashboard by re-reading at each heartbeat, the job feed by reading watched jobs each
second. Subscribers are told of each change of `live` (`live_changed`) after `subscribe()` returns.

Every hook runs on the event loop (`notified` from the socket's reader, or from psycopg while a
LISTEN runs, so a notification read then may arrive before that LISTEN's `missed()`): it must
return at once (set an event, start a task)."""

import asyncio
import logging
import sqlite3
from collections.abc import Callable, Iterable
from typing import Protocol

import psycopg
from django.db import connection
from psycopg.rows import TupleRow

from telemachus.control.notify import listen_connection_params
from telemachus.db.notify import DATA_VERSION, listen

log = logging.getLogger("telemachus.listener")
RECONNECT_FIRST_SECONDS = 0.5
RECONNECT_MAX_SECONDS = 10.0


class Subscriber(Protocol):
    def notified(self, channel: str, payload: str) -> None:
        """A NOTIFY on one of the subscriber's channels (PostgreSQL)."""

    def missed(self) -> None:
        """Something may have changed that no notification told of: look again. PostgreSQL: the
        subscriber just started hearing its channels; SQLite: another connection committed."""

    def live_changed(self, live: bool) -> None:
        """The subscription's `live` changed."""


class Subscription:
    """One subscriber's interest: its PostgreSQL channels, how often it wants SQLite watched (None:
    never) and, on SQLite, whether it wants watching now (`active`; PostgreSQL keeps listening
    regardless, so a subscriber can know what it missed while idle)."""

    def __init__(
        self,
        listener: "Listener",
        subscriber: Subscriber,
        *,
        channels: frozenset[str],
        sqlite_interval: float | None,
        active: bool,
    ) -> None:
        self.listener = listener
        self.subscriber = subscriber
        self.channels = channels
        self.sqlite_interval = sqlite_interval
        self.live = False
        self._active = active
        self._told: bool | None = None  # the `live` last told (None: nothing yet)
        self._seen: int | None = None  # SQLite: data_version when it last looked

    @property
    def active(self) -> bool:
        return self._active

    @active.setter
    def active(self, value: bool) -> None:
        if value != self._active:
            self._active = value
            if self.listener.vendor == "sqlite":  # PostgreSQL keeps listening regardless
                self.listener._wants_changed()

    def close(self) -> None:
        """Stop hearing (idempotent). The last subscription to close stops the listener."""
        self.listener._remove(self)

    async def aclose(self) -> None:
        """`close()`, then wait until the listener's connection is closed if this stopped it."""
        self.close()
        await self.listener._stopped()

    def _tell_live(self, live: bool) -> None:
        self.live = live
        if self._told is not live:
            self._told = live
            _call(self.subscriber.live_changed, live)


class Listener:
    """The process's listener (see the module doc); `Listener.current()`, then `subscribe()`."""

    _instances: dict[asyncio.AbstractEventLoop, "Listener"] = {}

    def __init__(self) -> None:
        self.vendor = connection.vendor
        self.subscriptions: list[Subscription] = []
        self.live = False  # connected (PostgreSQL) or watching (SQLite)
        self.listened: frozenset[str] = frozenset()  # PostgreSQL: channels LISTENed now
        self._task: asyncio.Task[None] | None = None
        self._wants = asyncio.Event()  # set when what the subscriptions want changed
        self._delay = RECONNECT_FIRST_SECONDS
        self._sqlite: sqlite3.Connection | None = None

    @classmethod
    def current(cls) -> "Listener":
        """The listener of the running event loop."""
        loop = asyncio.get_running_loop()
        listener = cls._instances.get(loop)
        if listener is None:
            cls._instances = {lp: li for lp, li in cls._instances.items() if not lp.is_closed()}
            listener = cls._instances[loop] = cls()
        return listener

    def subscribe(
        self,
        subscriber: Subscriber,
        *,
        channels: Iterable[str] = (),
        sqlite_interval: float | None = None,
        active: bool = True,
    ) -> Subscription:
        """Hear `channels` (PostgreSQL) or data_version every `sqlite_interval` seconds while
        `active` (SQLite). Starts the listener if it is not running."""
        subscription = Subscription(
            self, subscriber, channels=frozenset(channels), sqlite_interval=sqlite_interval, active=active
        )
        self.subscriptions.append(subscription)
        if self.vendor == "postgresql" and self.live and subscription.channels <= self.listened:
            # Heard from now on: nothing to miss, no LISTEN to take.
            subscription.live, subscription._told = True, True
        else:
            if self.vendor == "sqlite":
                subscription._seen = self._sqlite_version()
            self._wants_changed()
        if self._task is None or self._task.done() or self._task.cancelling():
            self._task = asyncio.create_task(self._run(), name="notify-listener")
        return subscription

    def _remove(self, subscription: Subscription) -> None:
        if subscription not in self.subscriptions:
            return
        self.subscriptions.remove(subscription)
        subscription.live = False
        if self.subscriptions:
            self._wants_changed()
            return
        if self._task is not None:
            self._task.cancel()
        self.live, self.listened = False, frozenset()
        if self._sqlite is not None:
            self._sqlite.close()
            self._sqlite = None

    async def _stopped(self) -> None:
        task = self._task
        if task is not None and not self.subscriptions and task is not asyncio.current_task():
            await asyncio.wait({task})

    def _wants_changed(self) -> None:
        self._wants.set()

    def _mine(self) -> bool:
        """Whether the running task is this listener's current one (a stopped one may still be
        closing its connection while a new one starts)."""
        return self._task is asyncio.current_task()

    async def _run(self) -> None:
        if self.vendor == "postgresql":
            await self._listen_forever()
        elif self.vendor == "sqlite":
            await self._watch_sqlite()

    # --- PostgreSQL ---------------------------------------------------------------------------

    async def _listen_forever(self) -> None:
        self._delay = RECONNECT_FIRST_SECONDS
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(**listen_connection_params(), autocommit=True) as conn:
                    # Every notification psycopg reads, ours (_read) or while it runs a LISTEN.
                    conn.add_notify_handler(self._deliver)
                    await self._listen_on(conn)
            except (psycopg.Error, OSError) as exc:
                log.warning("the listening connection was lost (%s); reconnecting in %.1fs", exc, self._delay)
            except Exception:  # a bug must not leave the process deaf for good
                log.exception("the listener failed; restarting in %.1fs", self._delay)
            if not self._mine():
                return
            self._down()
            await asyncio.sleep(self._delay)
            self._delay = min(self._delay * 2, RECONNECT_MAX_SECONDS)

    async def _listen_on(self, conn: psycopg.AsyncConnection[TupleRow]) -> None:
        listened: frozenset[str] = frozenset()
        while True:
            self._wants.clear()
            wanted = frozenset(c for s in self.subscriptions for c in s.channels)
            for channel in sorted(wanted - listened):
                await conn.execute(listen(channel))
            for channel in sorted(listened - wanted):
                await conn.execute(listen(channel, stop=True))
            listened = self.listened = wanted
            self.live, self._delay = True, RECONNECT_FIRST_SECONDS
            for subscription in list(self.subscriptions):
                if not subscription.live and subscription.channels <= listened:
                    subscription._tell_live(True)
                    _call(subscription.subscriber.missed)
            await self._hear(conn)

    async def _hear(self, conn: psycopg.AsyncConnection[TupleRow]) -> None:
        """Deliver notifications until what the subscriptions want changes (return) or the
        connection fails (raise)."""
        reader = asyncio.create_task(self._read(conn), name="notify-listener-read")
        wants = asyncio.create_task(self._wants.wait(), name="notify-listener-wants")
        try:
            done, _ = await asyncio.wait({reader, wants}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancelling the read gives the socket back to psycopg for the LISTENs to come; what
            # arrives while they run reaches the handler through psycopg.
            reader.cancel()
            wants.cancel()
            await asyncio.wait({reader, wants})
        if reader in done:
            reader.result()  # the connection's error
            raise psycopg.OperationalError("the notification stream ended")

    async def _read(self, conn: psycopg.AsyncConnection[TupleRow]) -> None:
        """Read notifications as the socket has them, until cancelled or the connection fails.

        One reader stays on the socket while nothing else uses the connection, and each time it
        is readable libpq takes the input and hands over what it holds. psycopg's `notifies()`
        instead adds and removes its reader and a 0.1 s timer for every batch it waits for: on a
        busy API process (two notifications per /v1/ call) that was a sixth of the event loop's
        time in a profile at one client. Nothing else touches the connection meanwhile: `_hear`
        cancels this before any LISTEN, which then reads through psycopg as usual."""
        loop, pgconn = asyncio.get_running_loop(), conn.pgconn
        failed: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                pgconn.consume_input()
                while (note := pgconn.notifies()) is not None:
                    if pgconn.notify_handler is not None:
                        pgconn.notify_handler(note)  # psycopg's: a Notify to our `_deliver`
            except psycopg.Error as exc:
                # libpq has closed the socket by now: off the loop at once, before its number is
                # given to another socket (the `finally` below runs a loop pass later).
                loop.remove_reader(fileno)
                if not failed.done():
                    failed.set_exception(exc)

        fileno = pgconn.socket
        loop.add_reader(fileno, readable)
        try:
            readable()  # what libpq read while a LISTEN ran, before the reader was back
            await failed
        finally:
            loop.remove_reader(fileno)

    def _deliver(self, note: psycopg.Notify) -> None:
        for subscription in list(self.subscriptions):
            if note.channel in subscription.channels:
                _call(subscription.subscriber.notified, note.channel, note.payload)

    def _down(self) -> None:
        self.live, self.listened = False, frozenset()
        for subscription in list(self.subscriptions):
            subscription._tell_live(False)

    # --- SQLite -------------------------------------------------------------------------------

    def _sqlite_version(self) -> int | None:
        """data_version now, from the watching connection (opened on first use); None when the
        database is not a file another connection could share."""
        if self._sqlite is None:
            path = str(connection.settings_dict["NAME"] or "")
            if not path or path.startswith((":memory:", "file:")):
                return None
            self._sqlite = sqlite3.connect(path, check_same_thread=False)
        version: int = self._sqlite.execute(DATA_VERSION).fetchone()[0]
        return version

    async def _watch_sqlite(self) -> None:
        try:
            while self._mine():
                watched = [s for s in self.subscriptions if s.active and s.sqlite_interval is not None]
                if not watched:
                    self._wants.clear()
                    await self._wants.wait()
                    continue
                version = self._sqlite_version()
                if version is None:
                    return
                self.live = True
                for subscription in watched:
                    subscription._tell_live(True)
                    if subscription._seen != version:
                        subscription._seen = version
                        _call(subscription.subscriber.missed)
                # Until the next look, or sooner if a subscriber comes, goes or wakes up.
                interval = min(s.sqlite_interval for s in watched if s.sqlite_interval is not None)
                self._wants.clear()
                try:
                    async with asyncio.timeout(interval):
                        await self._wants.wait()
                except TimeoutError:
                    pass
        finally:
            if self._mine():
                self._down()


def _call(hook: Callable[..., object], *args: object) -> None:
    """A subscriber's hook; its bug is logged, never allowed to stop the listener."""
    try:
        hook(*args)
    except Exception:
        log.exception("a notification subscriber failed")
