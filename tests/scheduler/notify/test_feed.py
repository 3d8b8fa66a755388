"""The job feed wakes a watch when its job changes in another process's transaction (NOTIFY on
PostgreSQL, data_version on SQLite), without the watcher reading the database to find out."""

import asyncio
import threading

import pytest
from django.db import connection

from scheduler.models import Job
from scheduler.notify.feed import JobFeed
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def job(member_setup) -> Job:
    return job_submit(
        user=member_setup[0],
        team="a",
        type="chat",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "hi"}]},
    )


def cancel_elsewhere(job_id: int) -> None:
    """Cancel on another thread, so on another database connection, committed there."""

    def cancel() -> None:
        try:
            job_cancel(job_id=job_id)
        finally:
            connection.close()

    thread = threading.Thread(target=cancel)
    thread.start()
    thread.join(timeout=30)


async def ready(feed: JobFeed) -> None:
    """On PostgreSQL, until the listener has connected. (SQLite's watcher compares with what it saw
    last, starting from nothing, so it misses nothing that happens before its first look.)"""
    for _ in range(600):
        if feed.listening or feed.vendor != "postgresql":
            return
        await asyncio.sleep(0.05)


def test_a_watch_wakes_when_its_job_changes_elsewhere(job):
    async def scenario():
        feed = JobFeed.current()
        await ready(feed)
        with feed.watch(job.pk) as watch:
            assert watch.take()[0], "a watch taken without a mark starts out changed: read the job first"
            await asyncio.sleep(0.05)
            watch.take()
            await asyncio.to_thread(cancel_elsewhere, job.pk)
            woke = await watch.wait(30)
            return woke, watch.take()

    woke, (changed, maybe_ended, deltas) = asyncio.run(scenario())
    assert woke and changed and maybe_ended and deltas == []


@pytest.mark.postgres
def test_a_watch_taken_after_a_change_since_a_mark_hears_of_it(job, member_setup):
    other = job_submit(
        user=member_setup[0],
        team="a",
        type="chat",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "hi"}]},
    )

    async def scenario():
        feed = JobFeed.current()
        await ready(feed)
        mark = feed.mark()
        await asyncio.to_thread(cancel_elsewhere, job.pk)
        for _ in range(600):
            if job.pk in feed.recent:
                break
            await asyncio.sleep(0.05)
        missed, untouched = feed.watch(job.pk, since=mark), feed.watch(other.pk, since=mark)
        return missed.take(), untouched.take()

    (changed, maybe_ended, _), (quiet, _, _) = asyncio.run(scenario())
    assert changed and maybe_ended, "the cancel between the mark and the watch is not lost"
    assert not quiet, "a job that did not change needs no read"
