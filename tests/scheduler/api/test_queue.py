from datetime import timedelta

import pytest
from django.utils import timezone

from quotas.models import QuotaPolicy
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
        {"team": "a", "queued": 3, "running": 0, "in_use": 0, "cap": 2, "weight": 3.0, "target_share": 0.75,
         "actual_share": 0.0, "not_served": []},
        {"team": "b", "queued": 1, "running": 0, "in_use": 0, "cap": None, "weight": 1.0, "target_share": 0.25,
         "actual_share": 0.0, "not_served": []},
    ]
    assert snapshot["executors"] == [
        {"name": "shared", "kind": "sim", "team": None, "enabled": True, "health": "ok", "breaker": "closed",
         "models": ["m"], "in_use": 0, "limit": 4}
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
    Job.objects.create(type="chat", user=bob, team=member_setup[3], model="m", status="done",
                       started_at=now - timedelta(seconds=40), finished_at=now - timedelta(seconds=10))

    teams = {t["team"]: t for t in api(operator).get("/api/queue/").json()["teams"]}

    assert teams["a"]["not_served"] == ["at team cap"]
    assert teams["b"]["not_served"] == ["over budget", "no executor offers the model"]
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
