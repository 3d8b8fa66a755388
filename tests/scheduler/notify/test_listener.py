"""The process's listener: subscribers in one process share one LISTEN connection, each hears its
own channels, and a lost connection is opened again with every subscriber told it may have missed
something. On SQLite: one data_version watch, and a subscriber that paused hears of what committed
meanwhile."""

import asyncio
import itertools
import time
from collections.abc import Callable

import pytest
from django.contrib.auth.models import Group
from django.db import connection, transaction

from scheduler.notify.listener import Listener
from telemachus.control import notify

pytestmark = pytest.mark.django_db(transaction=True)
_names = itertools.count(1)


class Recorder:
    """A subscriber that writes down what it is told."""

    def __init__(self) -> None:
        self.notes: list[tuple[str, str]] = []
        self.missed_count = 0
        self.lives: list[bool] = []

    def notified(self, channel: str, payload: str) -> None:
        self.notes.append((channel, payload))

    def missed(self) -> None:
        self.missed_count += 1

    def live_changed(self, live: bool) -> None:
        self.lives.append(live)


def on_another_connection(fn: Callable[[], object]) -> object:
    """Run `fn` in a transaction of a connection of its own (a thread's), committed there."""
    try:
        with transaction.atomic():
            return fn()
    finally:
        connection.close()


def send(*notes: tuple[str, str]) -> None:
    def run() -> None:
        with connection.cursor() as cursor:
            for channel, payload in notes:
                cursor.execute("SELECT pg_notify(%s, %s)", [channel, payload])

    on_another_connection(run)


def listen_backends() -> list[tuple[int, str]]:
    """(pid, application name) of this database's sessions whose last statement was a LISTEN."""

    def run() -> list[tuple[int, str]]:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid, application_name FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE 'LISTEN%%' AND pid <> pg_backend_pid()"
            )
            return list(cursor.fetchall())

    return on_another_connection(run)  # type: ignore[return-value]


def terminate(pids: list[int]) -> None:
    def run() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", [pids])

    on_another_connection(run)


async def until(predicate: Callable[[], object], what: str, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)
    assert predicate(), what


@pytest.mark.postgres
def test_subscribers_share_one_connection_and_hear_again_after_it_is_killed():
    async def scenario() -> None:
        # Given a worker-like subscriber on the workers' channel and a feed-like one on the jobs'
        # channel, in one process...
        listener = Listener.current()
        workers, jobs = Recorder(), Recorder()
        on_workers = listener.subscribe(workers, channels=[notify.WORKERS_CHANNEL])
        on_jobs = listener.subscribe(jobs, channels=[notify.JOBS_CHANNEL])
        await until(lambda: on_workers.live and on_jobs.live, "both subscribers to be live")

        # Then they share one LISTEN connection, and each was told once that it may have missed
        # something (nothing is heard before LISTEN takes effect)...
        backends = await asyncio.to_thread(listen_backends)
        assert len(backends) == 1, backends
        assert (workers.missed_count, jobs.missed_count) == (1, 1)

        # ...and each hears its own channel, only its own.
        await asyncio.to_thread(send, (notify.WORKERS_CHANNEL, notify.QUEUED), (notify.JOBS_CHANNEL, "c:7:finished"))
        await until(lambda: workers.notes and jobs.notes, "both notifications")
        assert workers.notes == [(notify.WORKERS_CHANNEL, notify.QUEUED)]
        assert jobs.notes == [(notify.JOBS_CHANNEL, "c:7:finished")]

        # When the LISTEN connection is killed on the server...
        await asyncio.to_thread(terminate, [pid for pid, _ in backends])

        # Then both are told they are not live, then live again and that they may have missed
        # something, through one new connection...
        await until(
            lambda: workers.missed_count == 2 and jobs.missed_count == 2, "both to be told they may have missed"
        )
        assert workers.lives == [True, False, True] and jobs.lives == [True, False, True]
        assert on_workers.live and on_jobs.live
        again = await asyncio.to_thread(listen_backends)
        assert len(again) == 1 and again[0][0] != backends[0][0], again

        # ...and both receive again.
        await asyncio.to_thread(send, (notify.JOBS_CHANNEL, "c:8:canceled"), (notify.WORKERS_CHANNEL, notify.FREED))
        await until(lambda: len(workers.notes) == 2 and len(jobs.notes) == 2, "notifications after the reconnect")
        assert workers.notes[-1] == (notify.WORKERS_CHANNEL, notify.FREED)
        assert jobs.notes[-1] == (notify.JOBS_CHANNEL, "c:8:canceled")

        # When the last subscriber leaves, the connection closes.
        on_workers.close()
        await on_jobs.aclose()
        assert not listener.live

    asyncio.run(scenario())

    def gone() -> bool:
        return not listen_backends()

    for _ in range(100):
        if gone():
            break
        time.sleep(0.05)
    assert gone(), "the LISTEN connection is closed"


@pytest.mark.postgres
def test_a_subscriber_that_wants_a_new_channel_is_told_when_it_takes_effect(settings):
    # Given a listener already live on the workers' channel, reaching PostgreSQL through
    # TELEMACHUS_LISTEN_DATABASE_URL (as behind a transaction-pooling PgBouncer)...
    s = connection.settings_dict
    settings.TELEMACHUS_LISTEN_DATABASE_URL = (
        f"postgres://{s['USER'] or 'postgres'}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
        "?application_name=telemachus-listen-test"
    )

    async def scenario() -> list[tuple[int, str]]:
        listener = Listener.current()
        workers, changes = Recorder(), Recorder()
        on_workers = listener.subscribe(workers, channels=[notify.WORKERS_CHANNEL])
        await until(lambda: on_workers.live, "the first subscriber to be live")

        # When a second subscriber wants the live-view channel...
        on_changes = listener.subscribe(changes, channels=[notify.CHANGES_CHANNEL])
        assert not on_changes.live, "not heard until LISTEN takes effect"
        await until(lambda: on_changes.live, "the second subscriber to be live")

        # Then it alone is told it may have missed something, and it hears its channel.
        assert (workers.missed_count, changes.missed_count) == (1, 1)
        await asyncio.to_thread(send, (notify.CHANGES_CHANNEL, "audit"))
        await until(lambda: changes.notes, "the live-view notification")
        assert changes.notes == [(notify.CHANGES_CHANNEL, "audit")] and workers.notes == []
        backends = await asyncio.to_thread(listen_backends)
        on_workers.close()
        await on_changes.aclose()
        return backends

    backends = asyncio.run(scenario())
    assert [name for _, name in backends] == ["telemachus-listen-test"], "the LISTEN URL is used"


def test_on_sqlite_a_paused_subscriber_hears_of_commits_made_while_it_was_paused():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's data_version watch")

    def commit() -> None:
        on_another_connection(lambda: Group.objects.create(name=f"group{next(_names)}"))

    async def scenario() -> None:
        # Given two subscribers, one of them paused (as the job feed is while no request waits)...
        listener = Listener.current()
        always, sometimes = Recorder(), Recorder()
        on_always = listener.subscribe(always, sqlite_interval=0.01)
        on_sometimes = listener.subscribe(sometimes, sqlite_interval=0.005, active=False)
        await until(lambda: on_always.live, "the watch to run")
        assert not on_sometimes.live and (always.missed_count, sometimes.missed_count) == (0, 0)

        # When another connection commits, the active one is told, the paused one is not...
        await asyncio.to_thread(commit)
        await until(lambda: always.missed_count == 1, "the active subscriber to be told")
        await asyncio.sleep(0.1)
        assert sometimes.missed_count == 0

        # ...and when the paused one resumes, it is told of the commit it did not see.
        on_sometimes.active = True
        await until(lambda: sometimes.missed_count == 1, "the resumed subscriber to be told")
        assert on_sometimes.live
        on_always.close()
        await on_sometimes.aclose()
        assert not listener.live

    asyncio.run(scenario())
