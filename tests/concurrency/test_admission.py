"""Admission under concurrency on PostgreSQL: team-owned executors and token budgets hold with
several worker processes."""

from collections import Counter
from datetime import timedelta

import pytest
from django.db.models import Count
from guardian.shortcuts import assign_perm

from executors.models import Executor
from quotas.models import QuotaPolicy, Usage
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.submit import job_submit
from tests.processes import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def submit_many(user, team: str, n: int, est: int = 0, **input_extra) -> list[int]:
    return [
        job_submit(
            user=user,
            team=team,
            type="chat",
            requirements={"model": "m", "est_tokens": est},
            input={"messages": [{"role": "user", "content": "go"}], **input_extra},
        ).pk
        for _ in range(n)
    ]


def test_team_owned_executor_never_receives_another_teams_job(processes, member_setup):
    alice, bob, team_a, team_b, shared = member_setup
    Executor.objects.filter(pk=shared.pk).update(max_concurrency=2, meta={"latency_ms": 20})
    Executor.objects.create(
        name="a-box",
        kind="sim",
        team=team_a,
        capabilities={"models": ["m"]},
        max_concurrency=8,
        meta={"latency_ms": 20},
    )
    a_jobs = submit_many(alice, "a", 60)
    submit_many(bob, "b", 60)
    for i in range(2):
        processes.worker(f"w{i}", concurrency=8)
    wait_until(lambda: not Job.objects.exclude(status="done").exists(), timeout=90, interval=0.2, what="all done")

    placed = Counter(
        (team, name)
        for team, name in JobEvent.objects.filter(event="placed").values_list("job__team__slug", "executor__name")
    )
    assert placed[("b", "a-box")] == 0, "team b's jobs never ran on team a's executor"
    assert placed[("a", "a-box")] > 0 and placed[("b", "shared")] == 60
    assert not Slot.objects.exists()
    assert set(Job.objects.filter(pk__in=a_jobs).values_list("executor__name", flat=True)) <= {"a-box", "shared"}


def test_granted_team_may_use_a_team_owned_executor(processes, member_setup):
    alice, bob, team_a, team_b, shared = member_setup
    Executor.objects.filter(pk=shared.pk).update(enabled=False)
    box = Executor.objects.create(
        name="a-box", kind="sim", team=team_a, capabilities={"models": ["m"]}, max_concurrency=4, meta={"latency_ms": 0}
    )
    Executor.objects.filter(pk=shared.pk).update(enabled=True)
    b_jobs = submit_many(bob, "b", 3)
    Executor.objects.filter(pk=shared.pk).update(enabled=False)
    assign_perm("executors.use_executor", team_b.group, box)
    processes.worker("w", concurrency=4)
    wait_until(lambda: Job.objects.filter(pk__in=b_jobs, status="done").count() == 3, timeout=30, what="b's jobs")
    assert set(Job.objects.filter(pk__in=b_jobs).values_list("executor__name", flat=True)) == {"a-box"}


def test_token_budget_holds_under_four_workers(processes, member_setup):
    # Given team a with a token budget, jobs that say they need 10 tokens but may use 15 (a 5-token
    # prompt and up to 10 completion tokens, which the model writes), 16 slots, and far more work
    # than budget...
    alice, bob, *_ = member_setup
    Executor.objects.filter(name="shared").update(max_concurrency=16, meta={"latency_ms": 30, "output_tokens": 10})
    limit, estimate, slots = 3000, 10, 16
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=slots)
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=limit, window="day")
    submit_many(alice, "a", 400, est=estimate, max_tokens=10)

    # When four workers drain it...
    for i in range(4):
        processes.worker(f"w{i}", concurrency=16)
    wait_until(
        lambda: JobEvent.objects.filter(event="deferred", job__isnull=True).exists(),
        timeout=90,
        interval=0.2,
        what="the budget to run out",
    )
    wait_until(lambda: not Job.objects.filter(status="running").exists(), timeout=30, what="in-flight work to end")
    # ...another team is served while team a is deferred.
    (bobs,) = submit_many(bob, "b", 1)
    wait_until(lambda: Job.objects.get(pk=bobs).status == "done", timeout=20, what="team b's job")

    # Then each job reserved what its request can cost (15, not the 10 it said), so billed usage
    # never passes the budget, on four workers at once, and nothing is left reserved.
    row = Usage.objects.get(scope="team", subject="a")
    done = Job.objects.filter(team__slug="a", status="done")
    billed = sum(done.values_list("tokens_used", flat=True))
    overshoot = row.tokens - limit
    print(f"\nbudget {limit}: billed {row.tokens} tokens for {done.count()} jobs, overshoot {overshoot}")
    assert row.tokens == billed
    assert row.reserved_tokens == 0 and row.reserved_requests == 0
    assert overshoot <= 0
    assert row.tokens > limit - 15, "the budget was really used up"
    counts = dict(Job.objects.filter(team__slug="a").values_list("status").annotate(n=Count("id")))
    assert counts["queued"] > 100 and set(counts) == {"done", "queued"}
    assert JobEvent.objects.filter(event="deferred", job__isnull=True).count() == 1

    # And when the window resets (moved into the past here), the deferred jobs run again.
    Usage.objects.update(window_start=row.window_start - timedelta(days=1))
    wait_until(
        lambda: Job.objects.filter(team__slug="a", status="done").count() > counts["done"],
        timeout=30,
        what="deferred jobs to run in the new window",
    )
