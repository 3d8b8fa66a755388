"""The queue tally on PostgreSQL (scheduler/migrations/0015_queue_tally.py): the submit reads each
team's queue depth from it instead of counting the queue, so it must be exact when submits race,
and match the queue after every kind of change (submit, bulk submit, claim, cancel, requeue,
recovery) made by real worker processes."""

import signal
import threading
import time

import pytest
from django.db import connection, connections

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.services.cancel import job_cancel
from scheduler.services.requeue import job_requeue
from scheduler.services.submit import JobSpec, job_submit, jobs_submit
from telemachus.errors import Conflict, TryLater
from tests.concurrency.sessions import postgres_session
from tests.processes import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

BODY = {
    "type": "chat",
    "requirements": {"model": "m", "est_tokens": 10},
    "input": {"messages": [{"role": "user", "content": "go"}], "max_tokens": 4},
}


def submit_in_thread(user, team: str, outcomes: list[str]) -> threading.Thread:
    """job_submit on a connection of its own; its outcome ("queued" or "try_later") appended."""

    def run() -> None:
        try:
            job_submit(user=user, team=team, **BODY)
            outcomes.append("queued")
        except TryLater:
            outcomes.append("try_later")
        except Exception as exc:
            outcomes.append(repr(exc))
            raise
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def waiting_on_locks(session) -> int:
    (n,) = session.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    return n


@pytest.mark.parametrize("budget", [False, True], ids=["one statement", "checked, with a budget"])
def test_two_racing_submits_never_both_pass_a_depth_bound_of_one(member_setup, budget):
    # Given team a with a queue depth cap of 1 (and, in the second case, a budget, which makes the
    # submit check in Python between its statements)...
    alice, _, team_a, _, _ = member_setup
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_queue_depth": {"a": 1}})
    if budget:
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=10_000, window="day")
    # ...and another session holding team a's row, so that both submits start, take their
    # snapshot and wait for the same lock...
    # (pg_stat_activity holds still within a transaction: another session watches it.)
    blocker, watcher = postgres_session(), postgres_session()
    try:
        blocker.execute("BEGIN")
        blocker.execute("SELECT 1 FROM telemachus_team WHERE id = %s FOR UPDATE", [team_a.pk])
        outcomes: list[str] = []
        threads = [submit_in_thread(alice, "a", outcomes) for _ in range(2)]
        wait_until(
            lambda: waiting_on_locks(watcher) == 2, timeout=20, what=f"both submits to wait on the lock: {outcomes}"
        )
        # When the lock is let go, the two submits race for the one place in the queue...
        blocker.execute("COMMIT")
        for thread in threads:
            thread.join(timeout=30)
    finally:
        blocker.close()
        watcher.close()

    # Then exactly one gets it: the second reads the first's job, though its snapshot is older.
    assert sorted(outcomes) == ["queued", "try_later"]
    assert Job.objects.filter(team=team_a, status="queued").count() == 1


def test_many_racing_submits_fill_the_queue_exactly_to_its_cap(member_setup):
    alice, _, team_a, _, _ = member_setup
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_queue_depth": {"a": 5}})
    outcomes: list[str] = []
    threads = [submit_in_thread(alice, "a", outcomes) for _ in range(16)]
    for thread in threads:
        thread.join(timeout=60)
    assert outcomes.count("queued") == 5 and outcomes.count("try_later") == 11
    assert Job.objects.filter(team=team_a, status="queued").count() == 5


def tally_against_queue() -> dict[int, tuple[int, int]]:
    """Each team's (queued jobs counted, depth from the tally), read in one statement (one
    snapshot): the tally changes in the transaction of the change it counts."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT t.id, (SELECT count(*) FROM scheduler_job j WHERE j.team_id = t.id AND j.status = 'queued'), "
            "(SELECT n FROM scheduler_queue_tally WHERE team_id = t.id AND side = 'in') "
            "- (SELECT n FROM scheduler_queue_tally WHERE team_id = t.id AND side = 'out') FROM telemachus_team t"
        )
        return {team: (counted, tallied) for team, counted, tallied in cursor.fetchall()}


def assert_tally_matches() -> None:
    seen = tally_against_queue()
    assert all(counted == tallied for counted, tallied in seen.values()), seen


@pytest.mark.slow
def test_the_tally_matches_the_queue_through_a_mixed_workload_with_workers(processes, member_setup, operator):
    # Given two teams' jobs, submitted one by one and in bulk, on an executor that takes 4 at a
    # time and 150 ms each, and a policy that requeues a dead worker's jobs...
    alice, bob, *_ = member_setup
    Executor.objects.filter(name="shared").update(max_concurrency=4, meta={"latency_ms": 150})
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 100})
    ids = [job_submit(user=user, team=team, **BODY).pk for user, team in [(alice, "a"), (bob, "b")] * 20]
    ids += [job.pk for job in jobs_submit(user=alice, jobs=[JobSpec(team="a", **BODY) for _ in range(30)])]
    assert_tally_matches()

    # When two workers run them, one of them is SIGKILLed mid-run (its jobs come back when their
    # lease ends), queued jobs are canceled and ended jobs requeued, while more are submitted...
    victim = processes.worker("victim", concurrency=4, lease=2)
    wait_until(lambda: Job.objects.filter(worker="victim", status="running").exists(), timeout=30, what="victim")
    processes.worker("survivor", concurrency=4, lease=2)
    victim.send_signal(signal.SIGKILL)
    canceled = []
    for pk in ids[-25:-10]:
        try:
            job_cancel(job_id=pk)
            canceled.append(pk)
        except Conflict:  # it ended first
            pass
        assert_tally_matches()
    for pk in canceled[:8]:
        try:
            job_requeue(job_id=pk, by=operator)
        except Conflict:
            pass
    for _ in range(10):
        job_submit(user=bob, team="b", **BODY)
        assert_tally_matches()
        time.sleep(0.05)

    # Then at every moment, and once all is done, each team's tally says what its queue holds.
    def settled() -> bool:
        assert_tally_matches()
        return not Job.objects.filter(status__in=["queued", "running"]).exists()

    wait_until(settled, timeout=120, interval=0.2, what="every job to end")
    assert JobEvent.objects.filter(event="requeued", meta__reason="lease expired").exists(), "a recovery happened"
    assert JobEvent.objects.filter(event="requeued", meta__reason="operator").exists(), "a requeue happened"
    assert JobEvent.objects.filter(event="canceled").exists()
    assert all(tallied == 0 for _, tallied in tally_against_queue().values())
