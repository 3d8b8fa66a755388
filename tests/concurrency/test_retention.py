"""Retention while the queue runs, on PostgreSQL: workers prune a backlog of old finished jobs
while jobs are submitted, claimed and finished; no session ever waits on a pruning transaction,
and no job is lost or finished twice."""

import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection, connections
from django.utils import timezone

from executors.models import Executor
from scheduler.models import Job, JobEvent
from scheduler.services.submit import job_submit
from telemachus.models import Team
from tests.processes import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BACKLOG = 20_000


def backlog(user, team, n: int) -> None:
    """`n` jobs that ended two hours ago, each with its queued, started and finished events."""
    then = timezone.now() - timedelta(hours=2)
    for start in range(0, n, 5000):
        jobs = Job.objects.bulk_create(
            Job(
                type="chat",
                user=user,
                team=team,
                model="m",
                status="done",
                input={"messages": [{"role": "user", "content": "x" * 200}]},
                result={"text": "y" * 200},
                submitted_at=then,
                finished_at=then,
                tokens_used=5,
            )
            for _ in range(start, min(n, start + 5000))
        )
        JobEvent.objects.bulk_create(
            JobEvent(job=job, event=kind, at=then) for job in jobs for kind in ("queued", "started", "finished")
        )


class LockWatch(threading.Thread):
    """Samples, on a connection of its own, every session of the queue's work (not itself pruning)
    waiting on a lock and whether what holds it up is a pruning transaction (its last statement: a
    batch's DELETE, whose CTE is `doomed` (telemachus/db/prune.py), or the upsert of what it
    deleted into scheduler_jobtally)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.samples = 0
        self.waits_on_pruning: list[str] = []

    def run(self) -> None:
        try:
            with connections["default"].cursor() as cursor:
                while not self.stop.is_set():
                    cursor.execute(
                        "SELECT waiting.query, blocker.query FROM pg_stat_activity waiting "
                        "JOIN pg_stat_activity blocker ON blocker.pid = ANY(pg_blocking_pids(waiting.pid)) "
                        "WHERE waiting.wait_event_type = 'Lock'"
                    )
                    # Two pruners' tally upserts of one key wait for each other, as any two
                    # increments of one row do; what matters is that the queue's work never waits.
                    self.waits_on_pruning += [
                        w for w, b in cursor.fetchall() if _pruning(b or "") and not _pruning(w or "")
                    ]
                    self.samples += 1
                    self.stop.wait(0.005)
        finally:
            connections["default"].close()


def _pruning(query: str) -> bool:
    return "doomed" in query or "scheduler_jobtally" in query


def test_pruning_a_backlog_while_jobs_flow_loses_nothing_and_blocks_nobody(processes, member_setup):
    # Given a backlog of old finished jobs in team a, whose retention is an hour...
    alice, _, a, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(max_concurrency=8)
    Team.objects.filter(pk=a.pk).update(retention_hours=1)
    backlog(alice, a, BACKLOG)
    watch = LockWatch()
    watch.start()

    # When two workers prune it in small batches while jobs are submitted, claimed and finished...
    env = {"TELEMACHUS_PRUNE_INTERVAL_SECONDS": "1", "TELEMACHUS_PRUNE_BATCH": "500"}
    processes.worker("w1", concurrency=8, **env)
    processes.worker("w2", concurrency=8, **env)
    fresh = []
    while Job.objects.filter(finished_at__lt=timezone.now() - timedelta(hours=1)).exists():
        fresh.append(
            job_submit(
                user=alice,
                team="a",
                type="chat",
                requirements={"model": "m"},
                input={"messages": [{"role": "user", "content": "now"}]},
            ).pk
        )
    wait_until(
        lambda: Job.objects.filter(pk__in=fresh, status="done").count() == len(fresh),
        timeout=120,
        interval=0.2,
        what="every fresh job done",
    )
    watch.stop.set()
    watch.join(timeout=10)

    # Then the backlog is gone, every fresh job finished exactly once and is kept, and no session
    # waited on a pruning transaction.
    assert len(fresh) > 50, "jobs flowed while the backlog was pruned"
    assert set(Job.objects.values_list("pk", flat=True)) == set(fresh)
    finished = Counter(JobEvent.objects.filter(event="finished").values_list("job_id", flat=True))
    assert set(finished) == set(fresh) and set(finished.values()) == {1}
    assert watch.samples > 100 and watch.waits_on_pruning == []
    with connection.cursor() as cursor:
        cursor.execute("SELECT sum(jobs) FROM scheduler_jobtally")
        assert cursor.fetchone()[0] == BACKLOG
