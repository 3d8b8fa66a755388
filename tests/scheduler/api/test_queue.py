import pytest

from quotas.models import QuotaPolicy
from scheduler.services.submit import job_submit

pytestmark = pytest.mark.django_db


def test_queue_shows_depth_caps_and_executors(api, operator, member_setup):
    alice, bob, *_ = member_setup
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=10)
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=2)
    for _ in range(3):
        job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    job_submit(user=bob, team="b", type="chat", requirements={"model": "m"}, input={"messages": []})

    snapshot = api(operator).get("/api/queue/").json()

    assert snapshot["global"] == {"in_use": 0, "cap": 10}
    assert snapshot["teams"] == [
        {"team": "a", "queued": 3, "running": 0, "in_use": 0, "cap": 2},
        {"team": "b", "queued": 1, "running": 0, "in_use": 0, "cap": None},
    ]
    assert snapshot["executors"] == [
        {"name": "shared", "kind": "sim", "team": None, "enabled": True, "health": "ok", "models": ["m"],
         "in_use": 0, "limit": 4}
    ]


def test_members_see_only_their_teams(api, member_setup, make_executor):
    alice, bob, _, team_b, _ = member_setup
    make_executor("b-private", team=team_b)
    job_submit(user=bob, team="b", type="chat", requirements={"model": "m"}, input={"messages": []})
    snapshot = api(alice).get("/api/queue/").json()
    assert [t["team"] for t in snapshot["teams"]] == ["a"]
    assert [e["name"] for e in snapshot["executors"]] == ["shared"]
    assert [u["user"] for u in snapshot["users"]] == ["alice"]
