"""Change notifications for open dashboards: one watcher per process (per event loop) wakes every
open dashboard when the database changes, instead of each socket re-reading on a timer.

It listens where the workers do: on PostgreSQL to NOTIFY on the workers' channel (work queued,
capacity freed, a job canceled) and on the live-view channel (claims, operator changes, breaker and
health changes: telemachus/control/changes.py); on SQLite it watches `PRAGMA data_version`, which moves on
every commit by any connection. The channel layer carries the dashboard's own actions
(broadcast.dashboard_changed_send), across processes when it is Redis."""

import asyncio
import logging
import sqlite3
import weakref

import psycopg
from django.db import connection

from scheduler.notify import channels as signals
from telemachus.control import changes

log = logging.getLogger("telemachus.dashboard")
SQLITE_WATCH_SECONDS = 0.05


class ChangeFeed:
    """Wakes its subscribers (asyncio events) on every change it hears of. `live` is False while it
    cannot hear changes (the LISTEN connection is down), so subscribers re-read on their own."""

    _feeds: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ChangeFeed]" = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.subscribers: set[asyncio.Event] = set()
        self.task: asyncio.Task | None = None
        self.live = False

    @classmethod
    def current(cls) -> "ChangeFeed":
        """The feed of the running event loop (daphne runs one per process)."""
        loop = asyncio.get_running_loop()
        feed = cls._feeds.get(loop)
        if feed is None:
            feed = cls._feeds[loop] = cls()
        return feed

    def subscribe(self) -> asyncio.Event:
        event = asyncio.Event()
        self.subscribers.add(event)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._watch(), name="dashboard-change-feed")
        return event

    def unsubscribe(self, event: asyncio.Event) -> None:
        self.subscribers.discard(event)
        if not self.subscribers and self.task is not None:
            self.task.cancel()
            self.task, self.live = None, False

    def changed(self) -> None:
        for event in self.subscribers:
            event.set()

    async def _watch(self) -> None:
        if connection.vendor == "postgresql":
            await self._listen()
        elif connection.vendor == "sqlite":
            await self._watch_sqlite()

    async def _listen(self) -> None:
        params = {
            k: v
            for k, v in connection.get_connection_params().items()
            if k not in {"cursor_factory", "context", "prepare_threshold"}
        }
        delay = 0.5
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(**params, autocommit=True) as conn:
                    await conn.execute(f"LISTEN {signals.CHANNEL}")
                    await conn.execute(f"LISTEN {changes.CHANNEL}")
                    self.live, delay = True, 0.5
                    self.changed()  # whatever happened before LISTEN took effect
                    async for _ in conn.notifies():
                        self.changed()
            except (psycopg.Error, OSError) as exc:
                log.warning("dashboard LISTEN connection lost (%s); dashboards re-read on their own", exc)
            self.live = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _watch_sqlite(self) -> None:
        path = str(connection.settings_dict["NAME"])
        if path.startswith((":memory:", "file:")):
            return
        watcher = sqlite3.connect(path, check_same_thread=False)
        try:
            seen = watcher.execute("PRAGMA data_version").fetchone()[0]
            self.live = True
            while True:
                await asyncio.sleep(SQLITE_WATCH_SECONDS)
                version = watcher.execute("PRAGMA data_version").fetchone()[0]
                if version != seen:
                    seen = version
                    self.changed()
        finally:
            self.live = False
            watcher.close()
