"""Worker processes: crash safety, cancel, head-of-line, graceful stop, a dropped database."""

import signal
from collections import Counter

import pytest
from django.db import connection
from django.db.models import Count

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from tests.processes import http_json, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def submit_many(user, team: str, n: int, model: str = "m") -> list[Job]:
    return [
        job_submit(
            user=user,
            team=team,
            type="chat",
            requirements={"model": model},
            input={"messages": [{"role": "user", "content": f"#{i}"}]},
        )
        for i in range(n)
    ]


def statuses() -> dict[str, int]:
    return dict(Job.objects.values_list("status").annotate(n=Count("id")))


def test_sigkilled_worker_loses_nothing_and_finishes_nothing_twice(processes, member_setup):
    # Given a worker holding four slow jobs, with a short lease...
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 1500}, max_concurrency=4)
    jobs = submit_many(alice, "a", 12)
    doomed = processes.worker("doomed", concurrency=4, lease=3)
    held = wait_until(
        lambda: (
            list(Job.objects.filter(status="running", worker="doomed").values_list("pk", flat=True))
            if Job.objects.filter(status="running", worker="doomed").count() == 4
            else None
        ),
        timeout=30,
        what="the worker to hold 4 running jobs",
    )

    # When it is killed mid-job and another worker takes over...
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=10)
    assert Slot.objects.count() == 4, "the dead worker's slots are still counted until recovery"
    processes.worker("rescuer", concurrency=4, lease=3)
    wait_until(lambda: statuses() == {"done": 12}, timeout=90, interval=0.2, what="all jobs done")

    # Then every job finished exactly once, the held ones after being requeued.
    finished = Counter(JobEvent.objects.filter(event="finished").values_list("job_id", flat=True))
    assert set(finished) == {job.pk for job in jobs} and set(finished.values()) == {1}
    requeued = set(JobEvent.objects.filter(event="requeued").values_list("job_id", flat=True))
    assert requeued == set(held)
    for job in Job.objects.filter(pk__in=held):
        assert job.attempts == 2 and job.worker == "rescuer"
    assert not Slot.objects.exists()


def test_cancel_of_a_running_job_frees_its_slot_and_stops_the_request(processes, member_setup):
    # Given a job running against a slow real model server...
    alice = member_setup[0]
    base = processes.simllm(latency_ms=30_000)
    Executor.objects.filter(name="shared").update(enabled=False)
    Executor.objects.create(name="slow", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["m"]})
    (job,) = submit_many(alice, "a", 1)
    worker = processes.worker("w", concurrency=2)
    wait_until(lambda: http_json(f"{base}/stats")["in_flight"] == 1, timeout=20, what="the request in flight")

    # When it is canceled...
    job_cancel(job_id=job.pk, by=alice)

    # Then its slot is free at once, and the worker hangs up on the model server promptly.
    assert not Slot.objects.exists()
    assert Job.objects.get(pk=job.pk).status == "canceled"
    wait_until(lambda: http_json(f"{base}/stats")["disconnects"] == 1, timeout=5, what="the upstream request to stop")
    assert http_json(f"{base}/stats")["in_flight"] == 0
    assert "aborting dispatch (canceled)" in worker.log_path.read_text()
    assert not JobEvent.objects.filter(event="finish_refused").exists()


def test_team_at_cap_does_not_delay_another_team(processes, member_setup):
    # Given team a at its cap with 100 jobs queued behind it...
    alice, bob, *_ = member_setup
    Executor.objects.filter(name="shared").update(meta={"latency_ms": 20_000}, max_concurrency=10)
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=2)
    submit_many(alice, "a", 102)
    processes.worker("w1", concurrency=8)
    processes.worker("w2", concurrency=8)
    wait_until(lambda: Job.objects.filter(status="running").count() == 2, timeout=20, what="team a at its cap")

    # When team b submits one job...
    (bobs,) = submit_many(bob, "b", 1)

    # Then it starts at once (placement latency, not the 20 s team a's jobs take).
    started = wait_until(lambda: Job.objects.get(pk=bobs.pk).started_at, timeout=5, what="team b's job to start")
    assert (started - bobs.submitted_at).total_seconds() < 1.0
    assert Job.objects.filter(team__slug="a", status="queued").count() == 100


def test_sigterm_drains_in_flight_work(processes, member_setup):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 1000})
    submit_many(alice, "a", 10)
    worker = processes.worker("w", concurrency=4)
    wait_until(lambda: Job.objects.filter(status="running").count() == 4, timeout=20, what="4 running")

    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0

    # The four in flight finished; nothing new was claimed after the signal.
    assert statuses() == {"done": 4, "queued": 6}
    assert not Slot.objects.exists()


def test_second_sigterm_gives_in_flight_work_back(processes, member_setup):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 60_000})
    submit_many(alice, "a", 3)
    worker = processes.worker("w", concurrency=4)
    wait_until(lambda: Job.objects.filter(status="running").count() == 3, timeout=20, what="3 running")

    worker.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping: draining 3 in flight" in worker.log_path.read_text(), timeout=5, what="drain")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0

    assert statuses() == {"queued": 3}
    assert not Slot.objects.exists()
    assert JobEvent.objects.filter(event="requeued", meta__reason="worker w shut down").count() == 3
    assert set(Job.objects.values_list("attempts", flat=True)) == {0}


def test_worker_survives_a_dropped_database_connection(processes, member_setup):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 50})
    submit_many(alice, "a", 5)
    worker = processes.worker("w", concurrency=4)
    wait_until(lambda: statuses() == {"done": 5}, timeout=30, what="first jobs done")

    # When every other connection to the database is cut (the worker's queries and its LISTEN)...
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert cursor.rowcount >= 1

    # Then the worker reconnects and goes on working.
    submit_many(alice, "a", 5)
    wait_until(lambda: statuses() == {"done": 10}, timeout=30, what="jobs after the cut to finish")
    assert worker.poll() is None
