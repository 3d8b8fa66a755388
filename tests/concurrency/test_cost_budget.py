"""A money budget (`ai.cost`) under four worker processes on PostgreSQL: the claims that reserve
against it are serialized, so together they never spend past it beyond what the reservations in
flight allow, and here (actual cost never above the estimate) not at all."""

from decimal import Decimal

import pytest

from executors.models import Executor
from quotas.models import QuotaPolicy, Spend, Usage
from scheduler.models import Job, JobEvent
from scheduler.services.submit import job_submit
from tests.processes import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_four_workers_never_spend_past_a_money_budget(processes, member_setup):
    # Given a price (3 per 1M prompt tokens, 7 per 1M completion tokens), calls that cost exactly
    # their estimate (a 5-token prompt, 10 completion tokens = max_tokens: 85 millionths), a budget
    # of 0.01 (room for 117 calls, not 118), 16 slots and far more work than money...
    alice, bob, *_ = member_setup
    Executor.objects.filter(name="shared").update(
        max_concurrency=16,
        meta={"latency_ms": 30, "output_tokens": 10},
        prices={"m": {"input": "3", "output": "7"}},
    )
    per_call, limit, slots = Decimal("0.000085"), Decimal("0.01"), 16
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=slots)
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.cost", limit=limit, window="day")
    for _ in range(300):
        job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "go"}], "max_tokens": 10},
        )

    # When four workers drain it...
    for i in range(4):
        processes.worker(f"w{i}", concurrency=16)
    # (What is left, 55 millionths, cannot pay for a call: each queued job is deferred on its own.)
    wait_until(
        lambda: JobEvent.objects.filter(event="deferred", meta__dimension="ai.cost").exists(),
        timeout=120,
        interval=0.2,
        what="the money to run out",
    )
    wait_until(lambda: not Job.objects.filter(status="running").exists(), timeout=30, what="in-flight work to end")

    # Then the budget was spent to within one call of its limit and never past it; every job's
    # cost is in the ledger, and nothing is left reserved.
    row = Usage.objects.get(scope="team", subject="a")
    done = Job.objects.filter(team__slug="a", status="done")
    billed = sum(done.values_list("cost", flat=True), Decimal(0))
    print(f"\nbudget {limit}: billed {row.cost} for {done.count()} calls of {per_call}")
    assert row.cost == billed == done.count() * per_call
    assert row.cost <= limit, "never past the budget"
    assert limit - row.cost < per_call, "the budget was really used up"
    assert done.count() == 117
    assert row.reserved_cost == 0
    assert Spend.objects.get(team__slug="a").cost == billed
    assert set(Job.objects.filter(team__slug="a").values_list("status", flat=True)) == {"done", "queued"}
    # Another team, with no money budget, is still served.
    bobs = job_submit(
        user=bob,
        team="b",
        type="chat",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "go"}], "max_tokens": 10},
    )
    wait_until(lambda: Job.objects.get(pk=bobs.pk).status == "done", timeout=20, what="team b's job")
