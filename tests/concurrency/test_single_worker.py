"""One worker process, on either backend: on SQLite this is the embedded default `make run` uses,
where a cancel reaches the worker through its heartbeat; on PostgreSQL through NOTIFY."""

import time
import uuid

import pytest
from django.db import connection
from django.db.models import Count

from executors.models import Executor
from scheduler.models import Job, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from tests.processes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def submit(user, n):
    return [
        job_submit(
            user=user,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": str(i)}]},
        )
        for i in range(n)
    ]


def test_worker_drains_the_queue_and_obeys_cancel(processes, member_setup):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 20}, max_concurrency=3)
    jobs = submit(alice, 20)
    processes.worker("w", concurrency=8)
    wait_until(
        lambda: dict(Job.objects.values_list("status").annotate(n=Count("id"))) == {"done": 20},
        timeout=60,
        interval=0.2,
        what="20 jobs done",
    )
    assert {j.executor_id for j in Job.objects.filter(pk__in=[j.pk for j in jobs])} == {executor.pk}

    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 60_000})
    (slow,) = submit(alice, 1)
    wait_until(lambda: Job.objects.get(pk=slow.pk).status == "running", timeout=10, what="slow job running")
    job_cancel(job_id=slow.pk)
    assert not Slot.objects.exists()
    log = processes.procs[-1].log_path
    aborted = ("aborting dispatch (lease lost)", "aborting dispatch (canceled)")
    wait_until(lambda: any(line in log.read_text() for line in aborted), timeout=5, what="worker to abort")
    connection.close()


def test_a_worker_whose_lease_is_taken_aborts_and_writes_nothing(processes, member_setup):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 60_000})
    (job,) = submit(alice, 1)
    worker = processes.worker("w", lease=3)
    wait_until(lambda: Job.objects.get(pk=job.pk).status == "running", timeout=10, what="the job to run")
    # As if the job had been recovered and claimed by another worker: the lease is no longer ours.
    thief = uuid.uuid4()
    Job.objects.filter(pk=job.pk).update(lease=thief)
    wait_until(
        lambda: "aborting dispatch (lease lost)" in worker.log_path.read_text(),
        timeout=10,
        what="the worker to abort its dispatch at the next heartbeat",
    )
    job.refresh_from_db()
    assert (job.status, job.lease) == ("running", thief)
    assert not job.events.filter(event__in=["finished", "failed", "requeued", "canceled"]).exists()
    connection.close()


def test_operator_edits_of_an_executor_apply_without_a_restart(processes, member_setup, api, operator):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 300}, max_concurrency=1)
    processes.worker("w", concurrency=8)
    admin = api(operator)
    url = f"/api/executors/{executor.pk}/"

    def peak_while_running(jobs) -> int:
        peak, ids = 0, [job.pk for job in jobs]
        while Job.objects.filter(pk__in=ids).exclude(status="done").exists():
            peak = max(peak, Slot.objects.filter(executor=executor).count())
            time.sleep(0.02)
        return peak

    assert peak_while_running(submit(alice, 4)) == 1
    assert admin.patch(url, {"max_concurrency": 3}, format="json").status_code == 200
    assert peak_while_running(submit(alice, 6)) == 3

    # Disabled: what runs finishes, nothing more is placed there, until it is enabled again.
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 1500})
    ids = [job.pk for job in submit(alice, 6)]
    wait_until(lambda: Slot.objects.count() == 3, timeout=5, what="the first three to start")
    assert admin.patch(url, {"enabled": False}, format="json").status_code == 200
    wait_until(lambda: Job.objects.filter(pk__in=ids, status="done").count() == 3, timeout=10, what="three done")
    time.sleep(1.0)
    assert Job.objects.filter(pk__in=ids, status="queued").count() == 3 and not Slot.objects.exists()
    assert admin.patch(url, {"enabled": True}, format="json").status_code == 200
    wait_until(lambda: Job.objects.filter(pk__in=ids, status="done").count() == 6, timeout=10, what="the rest")
    connection.close()
