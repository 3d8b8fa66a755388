from datetime import timedelta

import pytest
from django.utils import timezone

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.live.snapshot import dashboard_state
from scheduler.models import Job, QueuePolicy
from scheduler.services.claim import job_claim
from scheduler.services.submit import job_submit

pytestmark = pytest.mark.django_db


def submit(user, team, model="m"):
    return job_submit(user=user, team=team, type="chat", requirements={"model": model}, input={"messages": []})


def test_queue_shows_depth_caps_and_executors(api, operator, member_setup):
    alice, bob, *_ = member_setup
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=10)
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=2)
    QueuePolicy.objects.update_or_create(pk=1, defaults={"team_weights": {"a": 3, "b": 1}})
    for _ in range(3):
        submit(alice, "a")
    submit(bob, "b")

    snapshot = api(operator).get("/api/queue/").json()

    assert snapshot["global"] == {"in_use": 0, "cap": 10}
    assert snapshot["teams"] == [
        {
            "team": "a",
            "queued": 3,
            "running": 0,
            "in_use": 0,
            "cap": 2,
            "weight": 3.0,
            "target_share": 0.75,
            "share_if_busy": 0.75,
            "actual_share": 0.0,
            "retention_hours": 720,
            "body_retention_hours": None,
            "not_served": [],
            "waits": [],
        },
        {
            "team": "b",
            "queued": 1,
            "running": 0,
            "in_use": 0,
            "cap": None,
            "weight": 1.0,
            "target_share": 0.25,
            "share_if_busy": 0.25,
            "actual_share": 0.0,
            "retention_hours": 720,
            "body_retention_hours": None,
            "not_served": [],
            "waits": [],
        },
    ]
    assert snapshot["executors"] == [
        {
            "id": member_setup[4].pk,
            "name": "shared",
            "kind": "sim",
            "team": None,
            "enabled": True,
            "health": "ok",
            "breaker": "closed",
            "breaker_until": None,
            "models": ["m"],
            "in_use": 0,
            "limit": 4,
            "max_concurrency": 4,
        }
    ]


def test_why_a_team_is_not_served_and_actual_shares(api, operator, member_setup, make_executor):
    alice, bob, *_ = member_setup
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=1)
    QuotaPolicy.objects.create(scope="team", subject="b", dimension="ai.tokens", limit=0, window="day")
    llama = make_executor("llama", models=["llama"])
    submit(alice, "a")
    submit(alice, "a")
    job_claim(worker="w", limit=5)
    llama.enabled = False
    llama.save()
    Job.objects.create(type="chat", user=bob, team=member_setup[3], model="llama", requirements={"model": "llama"})
    # One finished attempt of b's, 30 s long, inside the share window.
    now = timezone.now()
    Job.objects.create(
        type="chat",
        user=bob,
        team=member_setup[3],
        model="m",
        status="done",
        started_at=now - timedelta(seconds=40),
        finished_at=now - timedelta(seconds=10),
    )

    teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}

    assert teams["a"]["not_served"] == ["at team cap"]
    reset = (timezone.now() + timedelta(days=1)).strftime("%Y-%m-%d 00:00")
    assert teams["b"]["not_served"] == [
        f"over budget: team b ai.tokens empty until {reset} UTC",
        "executor llama is disabled",
    ]
    assert [w["code"] for w in teams["b"]["waits"]] == ["budget_empty", "executor_disabled"]
    assert teams["b"]["waits"][0]["reset_at"].startswith(reset.replace(" ", "T"))
    assert 0.8 < teams["b"]["actual_share"] < 1.0 and 0 < teams["a"]["actual_share"] < 0.2


def test_user_and_global_caps_are_named(api, operator, member_setup):
    alice, bob, *_ = member_setup
    QuotaPolicy.objects.create(scope="user", subject="alice", dimension="ai.concurrency", limit=1)
    submit(alice, "a")
    submit(alice, "a")
    job_claim(worker="w", limit=5)
    teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}
    assert teams["a"]["not_served"] == ["at user cap"]

    QuotaPolicy.objects.create(scope="global", subject="", dimension="ai.concurrency", limit=1)
    submit(bob, "b")
    teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}
    assert teams["b"]["not_served"] == ["at global cap"]


def test_members_see_only_their_teams(api, member_setup, make_executor):
    alice, bob, _, team_b, _ = member_setup
    make_executor("b-private", team=team_b)
    submit(bob, "b")
    snapshot = api(alice).get("/api/queue/").json()
    assert [t["team"] for t in snapshot["teams"]] == ["a"]
    assert [e["name"] for e in snapshot["executors"]] == ["shared"]
    assert [u["user"] for u in snapshot["users"]] == ["alice"]


class TestEveryWaitReasonIsNamed:
    """Given one reason at a time that keeps a team's next job from starting, the queue names it,
    for the team and for the job on the dashboard."""

    def reasons(self, api, operator, team="a"):
        teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}
        return [w["code"] for w in teams[team]["waits"]]

    def test_executor_full(self, api, operator, member_setup):
        alice, _, _, _, executor = member_setup
        executor.max_concurrency = 1
        executor.save()
        submit(alice, "a")
        submit(alice, "a")
        job_claim(worker="w", limit=5)
        teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}
        assert teams["a"]["waits"] == [
            {"code": "executor_full", "text": "executor shared is full", "executor": "shared", "model": "m", "limit": 1}
        ]

    def test_an_executor_rule_makes_it_full_too(self, api, operator, member_setup):
        alice = member_setup[0]
        QuotaPolicy.objects.create(scope="executor", subject="shared", dimension="ai.concurrency", limit=1)
        submit(alice, "a")
        submit(alice, "a")
        job_claim(worker="w", limit=5)
        assert self.reasons(api, operator) == ["executor_full"]

    def test_breaker_open_and_down(self, api, operator, member_setup, make_executor):
        alice, _, _, _, executor = member_setup
        other = make_executor("second", models=["m"])
        submit(alice, "a")
        Executor.objects.filter(pk=executor.pk).update(
            breaker="open", breaker_until=timezone.now() + timedelta(minutes=1)
        )
        assert self.reasons(api, operator) == [], "the second executor can still take it"
        Executor.objects.filter(pk=other.pk).update(health="down")
        assert sorted(self.reasons(api, operator)) == ["executor_breaker_open", "executor_down"]
        Executor.objects.filter(pk=executor.pk).update(breaker_until=timezone.now() - timedelta(seconds=1))
        assert self.reasons(api, operator) == [], "the cooldown is over: a trial may go through"

    def test_no_executor_offers_the_model(self, api, operator, member_setup):
        alice, _, team_a, _, _ = member_setup
        Job.objects.create(type="chat", user=alice, team=team_a, model="gone", requirements={"model": "gone"})
        teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}
        assert teams["a"]["not_served"] == ["no executor offers the model"]

    def test_budgets_of_user_and_everyone(self, api, operator, member_setup):
        alice = member_setup[0]
        submit(alice, "a")
        QuotaPolicy.objects.create(scope="user", subject="alice", dimension="ai.requests", limit=0, window="hour")
        QuotaPolicy.objects.create(scope="global", dimension="ai.tokens", limit=0, window="minute")
        assert sorted(self.reasons(api, operator)) == ["budget_empty", "budget_empty"]
        texts = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}["a"]["not_served"]
        assert any(t.startswith("over budget: user alice ai.requests empty until ") for t in texts)
        assert any(t.startswith("over budget: global ai.tokens empty until ") for t in texts)

    def test_depth_cap(self, api, operator, member_setup):
        alice = member_setup[0]
        QueuePolicy.objects.update_or_create(pk=1, defaults={"max_queue_depth": {"a": 2}})
        submit(alice, "a")
        submit(alice, "a")
        teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}
        assert teams["a"]["waits"] == [
            {"code": "depth_cap", "cap": 2, "text": "queue at its depth cap (2): new jobs are refused"}
        ]


@pytest.mark.parametrize(
    ("change", "code", "text"),
    [
        ({"max_concurrency": 0}, "executor_no_capacity", "executor shared has capacity 0"),
        ({"enabled": False}, "executor_disabled", "executor shared is disabled"),
        ({"rule": 0}, "executor_no_capacity", "executor shared has capacity 0 (an executor concurrency rule)"),
    ],
)
def test_an_executor_with_no_capacity_is_named_as_the_reason(api, operator, member_setup, change, code, text):
    """A queue that waits on an executor someone set to 0 (or disabled) says so, on the queue
    (GET /api/queue/) and on the job's row of the dashboard, not "full" or nothing."""
    alice, _, _, _, executor = member_setup
    job = submit(alice, "a")
    if "rule" in change:
        QuotaPolicy.objects.create(scope="executor", subject="shared", dimension="ai.concurrency", limit=0)
    else:
        Executor.objects.filter(pk=executor.pk).update(**change)
    assert job_claim(worker="w", limit=5).claims == []

    team = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}["a"]
    assert team["not_served"] == [text] and [w["code"] for w in team["waits"]] == [code]
    (row,) = dashboard_state(user=alice)["jobs"]
    assert row["id"] == job.pk and row["waits"] == [text]
