"""One worker process, on either backend: on SQLite this is the embedded default `make run` uses,
where a cancel reaches the worker through its heartbeat; on PostgreSQL through NOTIFY."""

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
        job_submit(user=user, team="a", type="chat", requirements={"model": "m"},
                   input={"messages": [{"role": "user", "content": str(i)}]})
        for i in range(n)
    ]


def test_worker_drains_the_queue_and_obeys_cancel(processes, member_setup):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 20}, max_concurrency=3)
    jobs = submit(alice, 20)
    processes.worker("w", concurrency=8)
    wait_until(
        lambda: dict(Job.objects.values_list("status").annotate(n=Count("id"))) == {"done": 20},
        timeout=60, interval=0.2, what="20 jobs done",
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
