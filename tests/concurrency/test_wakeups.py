"""Freed capacity wakes a worker that can use it, whatever scope's cap binds, so a queue drains at
the cap's rate. Real worker processes and a real model server; the workers' safety timer is set
to a minute, so anything faster than that was woken on purpose.

Throughput is measured from the jobs' own timestamps in the database (first start to last
finish), not from the test's wall time, so a slow start on a loaded machine does not count."""

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Max, Min
from django.db.models.functions import Now

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.submit import job_submit
from tests.concurrency.slots import SlotSampler
from tests.processes import http_json, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# The model's latency is long beside a claim and a finish (tens of ms on a loaded two-core
# machine), so the bar below tests wake-ups, not the machine's speed (that is bench/'s job): a
# slot left for the safety timer costs a minute, against 0.4 s.
LATENCY_MS, CAP, JOBS = 400, 6, 240
# Workers that only wake on purpose (the safety timer would cap throughput near CAP a minute),
# run as deployed: with DEBUG off, Django keeps no log of every query; no line per job either.
WORKER = {
    "concurrency": 8,
    "extra": ("--idle-poll", "60"),
    "DEBUG": "0",
    "SECRET_KEY": "test-only-" + "x" * 50,
    "LOG_LEVEL": "WARNING",
}


def submit(user, team: str, n: int = 1) -> list[int]:
    return [
        job_submit(
            user=user,
            team=team,
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": f"#{i}"}], "max_tokens": 4},
        ).pk
        for i in range(n)
    ]


def drain_at_cap(scope: str, processes, make_user, make_team) -> None:
    # Given one model server answering in 200 ms, a cap of 6 slots in total at one scope (the
    # executor's max_concurrency; or 3 for each of two teams; or 3 for each of two users), and
    # 240 jobs from two teams...
    base = processes.simllm(latency_ms=LATENCY_MS)
    executor = Executor.objects.create(
        name="gpu",
        kind="local-model",
        endpoint=f"{base}/v1",
        capabilities={"models": ["m"]},
        max_concurrency=CAP if scope == "executor" else 100,
    )
    a1, b1 = make_user("a1"), make_user("b1")
    team_a, team_b = make_team("a", {a1: "member"}), make_team("b", {b1: "member"})
    if scope != "executor":
        for subject in ("a", "b") if scope == "team" else ("a1", "b1"):
            QuotaPolicy.objects.create(scope=scope, subject=subject, dimension="ai.concurrency", limit=CAP // 2)
    for _ in range(JOBS // 20):
        submit(a1, "a", 10)
        submit(b1, "b", 10)

    # When two worker processes drain the queue...
    # Sampling every 20 ms sees every 200 ms job's slot, without taking CPU from the workers.
    with SlotSampler(interval=0.02) as sampler:
        workers = [processes.worker(f"w{i}", **WORKER) for i in range(2)]
        wait_until(
            lambda: not Job.objects.exclude(status="done").exists(),
            timeout=240,
            interval=0.2,
            what=f"all {JOBS} jobs to finish",
        )

    # Then the cap held on the wire and in the database, and bound: the queue was kept waiting...
    stats = http_json(f"{base}/stats")
    assert stats["requests"] == JOBS
    assert CAP - 1 <= stats["peak"] <= CAP
    assert sampler.samples > 20 and sampler.peak_total <= CAP
    if scope == "executor":
        assert sampler.peak["executor"][executor.pk] <= CAP
    else:
        subjects = (team_a.pk, team_b.pk) if scope == "team" else (a1.pk, b1.pk)
        assert [sampler.peak[scope][pk] for pk in subjects] == [CAP // 2] * 2
    # ...and yet every freed slot was taken again at once: at least 80% of cap / latency.
    span = Job.objects.aggregate(first=Min("started_at"), last=Max("finished_at"))
    rate = JOBS / (span["last"] - span["first"]).total_seconds()
    assert rate >= 0.8 * CAP / (LATENCY_MS / 1000), f"{rate:.1f} jobs/s"
    # Every job ran once. (Either worker alone has room for the cap: a worker claims again what
    # its own finishes free, so one may well do all the work.)
    assert JobEvent.objects.filter(event="finished").count() == JOBS
    assert not Slot.objects.exists()
    assert {w.poll() for w in workers} == {None}


@pytest.mark.postgres
@pytest.mark.parametrize("scope", ["executor", "team", "user"])
def test_queue_drains_at_the_cap_on_postgres(scope, processes, make_user, make_team):
    drain_at_cap(scope, processes, make_user, make_team)


def test_queue_drains_at_the_executor_cap_on_sqlite(processes, make_user, make_team):
    if connection.vendor != "sqlite":
        pytest.skip("the SQLite run of the executor case (PostgreSQL runs the parametrized test)")
    drain_at_cap("executor", processes, make_user, make_team)


def test_a_raised_cap_wakes_a_waiting_worker(processes, member_setup):
    # Given a global cap of 1 held by a long job, and a second job waiting for it...
    alice, _, _, _, shared = member_setup
    Executor.objects.filter(pk=shared.pk).update(meta={"latency_ms": 30_000})
    rule = QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=1)
    first, second = submit(alice, "a", 2)
    processes.worker("w", **WORKER)
    wait_until(lambda: Job.objects.filter(status="running").count() == 1, timeout=30, what="the first job to run")

    # When an operator raises the cap (a plain UPDATE: the database notices, not the service)...
    QuotaPolicy.objects.filter(pk=rule.pk).update(limit=2)

    # Then the waiting job starts long before the worker's safety timer would have fired.
    wait_until(lambda: Job.objects.get(pk=second).status == "running", timeout=30, what="the second job to start")


def test_a_retry_starts_when_its_backoff_ends(processes, member_setup):
    # Given a job that must wait 3 s more before it may run (as a retry after a failure does)...
    alice = member_setup[0]
    (job,) = submit(alice, "a")
    Job.objects.filter(pk=job).update(run_after=Now() + timedelta(seconds=3))
    run_after = Job.objects.get(pk=job).run_after

    # When an idle worker is running...
    processes.worker("w", **WORKER)

    # Then it starts the job when the backoff ends: the claim told it when to come back.
    wait_until(lambda: Job.objects.get(pk=job).status == "done", timeout=40, what="the job to run")
    started = Job.objects.get(pk=job).started_at
    assert run_after <= started and (started - run_after).total_seconds() < 30
