"""The queue policy with several worker processes on PostgreSQL: scripted scenarios, one slot in
the whole system (a global cap of 1), so the order jobs start in is exactly the policy's order."""

from datetime import timedelta

import pytest
from django.utils import timezone

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.services.submit import job_submit
from telemachus.teams.services import team_member_set
from tests.conftest import backdate
from tests.processes import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def one_slot(member_setup):
    """Teams a (alice) and b (bob), a sim executor, one slot in all, and a policy record."""
    Executor.objects.filter(name="shared").update(meta={"latency_ms": 40})
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=1)
    QueuePolicy.objects.update_or_create(pk=1, defaults={"entry_penalty": 0})
    return member_setup


def submit(user, team, priority=0):
    return job_submit(
        user=user,
        team=team,
        type="chat",
        priority=priority,
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "x"}]},
    )


def start_order(processes, jobs, workers=3, **env):
    for i in range(workers):
        processes.worker(f"w{i}", concurrency=4, **env)
    ids = [job.pk for job in jobs]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status="done").count() == len(ids),
        timeout=120,
        interval=0.2,
        what="the scenario's jobs to finish",
    )
    return list(
        JobEvent.objects.filter(event="started", job__in=ids).order_by("at", "id").values_list("job_id", flat=True)
    )


def test_one_job_of_a_quiet_team_goes_before_a_thousand_of_a_busy_one(processes, one_slot):
    alice, bob, team_a, *_ = one_slot
    first = submit(alice, "a")
    Job.objects.bulk_create(
        [
            Job(type="chat", user=alice, team=team_a, model="m", requirements={"model": "m"}, input={"messages": []})
            for _ in range(999)
        ]
    )
    worker = processes.worker("w0", concurrency=4)
    wait_until(lambda: Job.objects.filter(status="running").exists(), timeout=20, what="team a to start")
    lone = submit(bob, "b")
    submitted = timezone.now()
    wait_until(lambda: Job.objects.get(pk=lone.pk).status == "done", timeout=20, what="team b's job")
    started = list(JobEvent.objects.filter(event="started").order_by("at", "id").values_list("job_id", flat=True))
    position = started.index(lone.pk)
    assert position <= 2, f"team b's job started {position}th"
    assert started[0] == first.pk
    # Exactly: every claim that began after the submit had returned (a claim reads its clock once
    # it holds the claim lock, so it could see the job) took team b's job, not team a's.
    lone.refresh_from_db()
    assert not Job.objects.filter(team=team_a, started_at__gt=submitted, started_at__lt=lone.started_at).exists()
    worker.terminate()


def test_weight_zero_and_priority_before_share(processes, one_slot):
    alice, bob, team_a, *_ = one_slot
    QueuePolicy.objects.filter(pk=1).update(team_weights={"a": 0})
    spare = [submit(alice, "a", priority=90) for _ in range(2)]
    b_low = submit(bob, "b", priority=0)
    b_high = submit(bob, "b", priority=5)
    assert start_order(processes, [*spare, b_low, b_high]) == [b_high.pk, b_low.pk, spare[0].pk, spare[1].pk]


def test_equal_weights_alternate_and_priority_wins(processes, one_slot):
    alice, bob, *_ = one_slot
    # An entry penalty far above the jobs' 40 ms makes each start cost about the same, so equal
    # weights interleave; which of two teams with equal usage goes first is decided by the
    # milliseconds their last jobs took, so the test bounds the lead instead of fixing the order.
    QueuePolicy.objects.filter(pk=1).update(entry_penalty=10)
    a_jobs = [submit(alice, "a") for _ in range(5)]
    b_jobs = [submit(bob, "b") for _ in range(5)]
    urgent = submit(bob, "b", priority=10)
    order = start_order(processes, [*a_jobs, *b_jobs, urgent])
    assert order[0] == urgent.pk
    teams = dict(Job.objects.filter(pk__in=order).values_list("pk", "team__slug"))
    lead = 1  # team b's urgent job ran first; first-come-first-served would put a 4 ahead
    for pk in order[1:]:
        lead += 1 if teams[pk] == "b" else -1
        assert abs(lead) <= 2, [teams[pk] for pk in order]


def test_aging_lifts_a_starved_job(processes, one_slot):
    alice, bob, *_ = one_slot
    QueuePolicy.objects.filter(pk=1).update(aging_after_seconds=60, aging_step_seconds=10, aging_max_boost=5)
    old = submit(alice, "a", priority=-2)
    backdate(old.pk, timedelta(minutes=5))
    newer = [submit(bob, "b", priority=2) for _ in range(2)]
    assert start_order(processes, [old, *newer]) == [old.pk, *[j.pk for j in newer]]


def test_clamped_priority_runs_where_it_was_clamped_to(processes, one_slot, operator):
    alice, bob, team_a, *_ = one_slot
    team_member_set(team=team_a, username="operator", role="member")
    QueuePolicy.objects.filter(pk=1).update(priority_map={"member": 1})
    greedy = submit(alice, "a", priority=50)
    assert greedy.priority == 1
    boss = submit(operator, "a", priority=20)
    normal = submit(bob, "b", priority=0)
    assert start_order(processes, [greedy, boss, normal]) == [boss.pk, greedy.pk, normal.pk]
    assert JobEvent.objects.filter(job=greedy, event="priority_clamped").count() == 1


def test_depth_cap_with_retry_after(api, one_slot):
    alice = one_slot[0]
    QueuePolicy.objects.filter(pk=1).update(max_queue_depth={"default": 3})
    client = api(alice)
    body = {
        "type": "chat",
        "team": "a",
        "requirements": {"model": "m"},
        "input": {"messages": [{"role": "user", "content": "x"}]},
    }
    statuses = [client.post("/api/jobs/", body, format="json") for _ in range(5)]
    assert [r.status_code for r in statuses] == [201, 201, 201, 429, 429]
    assert statuses[3]["Retry-After"] == "60" and statuses[3].json()["error"] == "try_later"


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ("least-loaded", {"small": 1, "big": 3}),
        ("pack", {"small": 2, "big": 2}),
        ("weighted", {"small": 1, "big": 3}),
    ],
)
def test_placement_rules_with_workers(processes, member_setup, rule, expected):
    alice = member_setup[0]
    Executor.objects.filter(name="shared").delete()
    Executor.objects.create(
        name="small", kind="sim", capabilities={"models": ["m"]}, max_concurrency=2, weight=1, meta={"latency_ms": 3000}
    )
    Executor.objects.create(
        name="big", kind="sim", capabilities={"models": ["m"]}, max_concurrency=6, weight=3, meta={"latency_ms": 3000}
    )
    QueuePolicy.objects.update_or_create(pk=1, defaults={"placement": rule})
    jobs = [submit(alice, "a") for _ in range(4)]
    processes.worker("w0", concurrency=8)
    wait_until(
        lambda: Job.objects.filter(pk__in=[j.pk for j in jobs], status="running").count() == 4,
        timeout=20,
        what="all four placed",
    )
    placed = list(Job.objects.filter(status="running").values_list("executor__name", flat=True))
    assert {name: placed.count(name) for name in ("small", "big")} == expected


def test_custom_policy_from_the_setting(processes, one_slot, make_user, make_team):
    alice = one_slot[0]
    helper = make_user("helper")
    make_team("support", {helper: "member"})
    ops_jobs = [submit(alice, "a") for _ in range(3)]
    tickets = [submit(helper, "support") for _ in range(2)]
    order = start_order(processes, [*ops_jobs, *tickets], TELEMACHUS_QUEUE_POLICY="tests.policies.AlwaysBusinessHours")
    assert order[:2] == [t.pk for t in tickets]
