"""Caps hold on the wire and in the database with many worker processes on PostgreSQL."""

import threading
from collections import Counter

import pytest
from django.db import connection
from django.db.models import Count

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.claim import job_claim
from scheduler.services.submit import job_submit
from telemachus.teams.services import team_member_set
from tests.concurrency.slots import SlotSampler
from tests.processes import http_json, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_four_workers_never_exceed_any_cap(processes, make_user, make_team):
    # Given two executors on one real HTTP model server (counted apart by path), caps at all four
    # scopes below the offered load (4 workers x 16 = 64 dispatches), and 500 jobs from three users.
    base = processes.simllm(latency_ms=40)
    e1 = Executor.objects.create(
        name="e1", kind="local-model", endpoint=f"{base}/e1/v1", capabilities={"models": ["m"]}, max_concurrency=6
    )
    e2 = Executor.objects.create(
        name="e2", kind="local-model", endpoint=f"{base}/e2/v1", capabilities={"models": ["m"]}, max_concurrency=3
    )
    a1, a2, b1 = make_user("a1"), make_user("a2"), make_user("b1")
    team_a, team_b = make_team("a", {a1: "member", a2: "member"}), make_team("b", {b1: "member"})
    caps = {"global": 8, "team_a": 5, "user_a1": 3}
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=caps["global"])
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=caps["team_a"])
    QuotaPolicy.objects.create(scope="user", subject="a1", dimension="ai.concurrency", limit=caps["user_a1"])
    for user, team, n in ((a1, "a", 200), (a2, "a", 150), (b1, "b", 150)):
        for i in range(n):
            job_submit(
                user=user,
                team=team,
                type="chat",
                requirements={"model": "m", "est_tokens": 10},
                input={"messages": [{"role": "user", "content": f"job {i}"}], "max_tokens": 4},
            )
    sampler = SlotSampler()
    sampler.start()

    # When four worker processes drain the queue.
    workers = [processes.worker(f"w{i}", concurrency=16) for i in range(4)]
    try:
        wait_until(
            lambda: not Job.objects.exclude(status__in=Job.TERMINAL).exists(),
            timeout=240,
            interval=0.5,
            what="all 500 jobs to finish",
        )
    finally:
        sampler.stop.set()
        sampler.join()

    # Then no cap was ever exceeded, on the wire or in the database...
    stats = http_json(f"{base}/stats")
    assert stats["peak"] <= caps["global"]
    assert stats["prefixes"]["e1"]["peak"] <= 6 and stats["prefixes"]["e2"]["peak"] <= 3
    assert sampler.samples > 50
    assert sampler.peak_total <= caps["global"]
    assert sampler.peak["executor"][e1.pk] <= 6 and sampler.peak["executor"][e2.pk] <= 3
    assert sampler.peak["team"][team_a.pk] <= caps["team_a"]
    assert sampler.peak["user"][a1.pk] <= caps["user_a1"]
    # ...while the load really pressed on the caps (this is not a test that cannot fail).
    assert stats["peak"] >= caps["global"] - 1
    assert sampler.peak["team"][team_a.pk] == caps["team_a"]
    assert sampler.peak["user"][a1.pk] == caps["user_a1"]
    # And every job ran and finished exactly once.
    assert dict(Job.objects.values_list("status").annotate(n=Count("id"))) == {"done": 500}
    assert stats["requests"] == 500
    finished = Counter(JobEvent.objects.filter(event="finished").values_list("job_id", flat=True))
    assert len(finished) == 500 and set(finished.values()) == {1}
    assert not JobEvent.objects.filter(event__in=["finish_refused", "requeued"]).exists()
    assert not Slot.objects.exists()
    assert {w.poll() for w in workers} == {None}, "workers are still alive"
    assert Job.objects.filter(tokens_used__gt=0).count() == 500
    assert team_b.pk in sampler.peak["team"]


def test_racing_claims_never_share_the_last_slot(member_setup, make_user):
    # Given a global cap of one slot and plenty of work...
    alice = member_setup[0]
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=1)
    for _ in range(20):
        job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})

    # When eight claims race, each on its own connection, released together...
    barrier = threading.Barrier(8)
    results: list[int] = []

    def race() -> None:
        try:
            barrier.wait()
            results.append(len(job_claim(worker=threading.current_thread().name, limit=3).claims))
        finally:
            connection.close()

    threads = [threading.Thread(target=race, name=f"t{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # Then exactly one slot was taken.
    assert sorted(results) == [0] * 7 + [1]
    assert Slot.objects.count() == 1
    assert Job.objects.filter(status="running").count() == 1


def test_team_and_user_caps_hold_under_racing_claims(member_setup, make_user, make_executor):
    alice, bob, team_a, _, _ = member_setup
    make_executor("second", models=["m"], max_concurrency=50)
    carol = make_user("carol")
    team_member_set(team=team_a, username="carol", role="member")
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=3)
    QuotaPolicy.objects.create(scope="user", subject="bob", dimension="ai.concurrency", limit=2)
    for user, team in ((alice, "a"), (carol, "a"), (bob, "b")):
        for _ in range(10):
            job_submit(user=user, team=team, type="chat", requirements={"model": "m"}, input={"messages": []})

    barrier = threading.Barrier(6)

    def race() -> None:
        try:
            barrier.wait()
            for _ in range(3):
                job_claim(worker=threading.current_thread().name, limit=2)
        finally:
            connection.close()

    threads = [threading.Thread(target=race, name=f"t{i}") for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert Slot.objects.filter(team=team_a).count() == 3
    assert Slot.objects.filter(user=bob).count() == 2
