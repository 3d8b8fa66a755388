from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, QueuePolicy, Slot
from scheduler.services.claim import job_claim

pytestmark = pytest.mark.django_db


def claimed_ids(batch):
    return [claim.job.pk for claim in batch.claims]


class TestOrder:
    def test_priority_then_submission_order_across_teams(self, member_setup, submit):
        alice, bob, a, b, _ = member_setup
        first = submit(alice, a)
        urgent = submit(bob, b, priority=5)
        second = submit(bob, b)
        third = submit(alice, a)
        assert claimed_ids(job_claim(worker="w", limit=10)) == [urgent.pk, first.pk, second.pk, third.pk]

    def test_limit(self, member_setup, submit):
        alice, _, a, _, _ = member_setup
        jobs = [submit(alice, a) for _ in range(3)]
        batch = job_claim(worker="w", limit=2)
        assert claimed_ids(batch) == [jobs[0].pk, jobs[1].pk]
        assert batch.backlog is True
        assert claimed_ids(job_claim(worker="w", limit=2)) == [jobs[2].pk]

    def test_empty_queue(self, member_setup):
        batch = job_claim(worker="w", limit=4)
        assert batch.claims == [] and batch.backlog is False


class TestClaimWrites:
    def test_lease_slot_and_events(self, member_setup, submit):
        alice, _, a, _, executor = member_setup
        job = submit(alice, a)
        (claim,) = job_claim(worker="w1", limit=1).claims
        job.refresh_from_db()
        assert job.status == "running" and job.executor == executor and job.worker == "w1"
        assert job.attempts == 1 and job.lease == claim.lease and job.started_at is not None
        assert job.lease_expires_at - job.started_at == timedelta(seconds=30)
        slot = Slot.objects.get()
        assert (slot.pk, slot.job, slot.executor, slot.team, slot.user) == (claim.slot_id, job, executor, a, alice)
        assert list(job.events.values_list("event", flat=True)) == ["queued", "placed", "started"]
        assert job.events.get(event="placed").executor == executor

    def test_claimed_job_carries_its_input(self, member_setup, submit):
        # The worker dispatches from async code, where a lazy load of a deferred field would raise:
        # the claim must hand over the payload it left out of the queue lookups.
        alice, _, a, _, _ = member_setup
        submit(alice, a)
        (claim,) = job_claim(worker="w", limit=1).claims
        assert "input" not in claim.job.get_deferred_fields()
        with CaptureQueriesContext(connection) as reads:
            assert claim.job.input == {"messages": [{"role": "user", "content": "hi"}]}
        assert reads.captured_queries == []

    def test_query_count_does_not_grow_with_queue_depth(self, member_setup, submit):
        alice, bob, a, b, _ = member_setup
        submit(alice, a)
        submit(bob, b)
        with CaptureQueriesContext(connection) as shallow:
            assert len(job_claim(worker="w", limit=1).claims) == 1
        for _ in range(200):
            submit(alice, a)
            submit(bob, b)
        with CaptureQueriesContext(connection) as deep:
            assert len(job_claim(worker="w", limit=1).claims) == 1
        assert len(deep.captured_queries) == len(shallow.captured_queries) <= 20


class TestCaps:
    def test_global_cap(self, member_setup, submit, cap, make_executor):
        alice, _, a, _, _ = member_setup
        make_executor("second", models=["m"])
        cap("global", None, 3)
        for _ in range(6):
            submit(alice, a)
        assert len(job_claim(worker="w", limit=10).claims) == 3
        batch = job_claim(worker="w", limit=10)
        assert batch.claims == [] and batch.backlog is True

    def test_executor_max_concurrency_and_executor_quota(self, member_setup, submit, cap):
        alice, _, a, _, executor = member_setup
        for _ in range(6):
            submit(alice, a)
        assert len(job_claim(worker="w", limit=10).claims) == 4
        Slot.objects.all().delete()
        Job.objects.filter(status="running").update(status="done", lease=None, lease_expires_at=None)
        cap("executor", "shared", 1)
        assert len(job_claim(worker="w", limit=10).claims) == 1

    def test_team_at_cap_does_not_block_other_teams(self, member_setup, submit, cap):
        alice, bob, a, b, _ = member_setup
        cap("team", "a", 1)
        for _ in range(100):
            submit(alice, a)
        bobs = submit(bob, b)
        assert len(job_claim(worker="w", limit=1).claims) == 1
        assert claimed_ids(job_claim(worker="w", limit=1)) == [bobs.pk]

    def test_user_at_cap_does_not_block_teammates(self, member_setup, submit, cap, make_user):
        alice, _, a, _, _ = member_setup
        carol = make_user("carol")
        from telemachus.teams.services import team_member_set

        team_member_set(team=a, username="carol", role="member")
        cap("user", "alice", 2)
        alices = [submit(alice, a) for _ in range(5)]
        carols = submit(carol, a)
        assert claimed_ids(job_claim(worker="w", limit=3)) == [alices[0].pk, alices[1].pk, carols.pk]

    def test_cap_of_zero_pauses_a_team(self, member_setup, submit, cap):
        alice, _, a, _, _ = member_setup
        cap("team", "a", 0)
        submit(alice, a)
        assert job_claim(worker="w", limit=1).claims == []

    def test_caps_count_existing_slots(self, member_setup, submit, cap):
        alice, _, a, _, _ = member_setup
        cap("team", "a", 2)
        for _ in range(4):
            submit(alice, a)
        assert len(job_claim(worker="w1", limit=1).claims) == 1
        assert len(job_claim(worker="w2", limit=5).claims) == 1
        assert Slot.objects.filter(team=a).count() == 2


class TestPlacement:
    def test_least_loaded(self, member_setup, submit, make_executor):
        alice, _, a, _, shared = member_setup
        big = make_executor("big", models=["m"], max_concurrency=8)
        for _ in range(5):
            submit(alice, a)
        placed = [claim.executor.name for claim in job_claim(worker="w", limit=5).claims]
        assert sorted(placed) == ["big", "big", "big", "shared", "shared"]
        assert Slot.objects.filter(executor=big).count() == 3

    def test_pack(self, member_setup, submit, make_executor):
        alice, _, a, _, _ = member_setup
        make_executor("other", models=["m"], max_concurrency=4)
        QueuePolicy.objects.update_or_create(pk=1, defaults={"placement": "pack"})
        for _ in range(5):
            submit(alice, a)
        placed = [claim.executor.name for claim in job_claim(worker="w", limit=5).claims]
        assert placed == ["other"] * 4 + ["shared"]

    def test_only_executors_offering_the_model(self, member_setup, submit, make_executor):
        alice, _, a, _, _ = member_setup
        make_executor("llama-box", models=["llama"])
        submit(alice, a, model="llama")
        assert job_claim(worker="w", limit=1).claims[0].executor.name == "llama-box"

    def test_full_model_does_not_block_the_teams_other_models(self, member_setup, submit, make_executor):
        alice, _, a, _, _ = member_setup
        make_executor("tiny", models=["llama"], max_concurrency=1)
        submit(alice, a, model="llama")
        blocked = submit(alice, a, model="llama")
        other = submit(alice, a, model="m")
        job_claim(worker="w", limit=1)
        assert claimed_ids(job_claim(worker="w", limit=2)) == [other.pk]
        assert Job.objects.get(pk=blocked.pk).status == "queued"

    def test_disabled_and_down_executors_are_skipped(self, member_setup, submit):
        alice, _, a, _, shared = member_setup
        submit(alice, a)
        Executor.objects.filter(pk=shared.pk).update(enabled=False)
        assert job_claim(worker="w", limit=1).claims == []
        Executor.objects.filter(pk=shared.pk).update(enabled=True, health="down")
        assert job_claim(worker="w", limit=1).claims == []
        Executor.objects.filter(pk=shared.pk).update(health="degraded")
        assert len(job_claim(worker="w", limit=1).claims) == 1

    def test_team_owned_executor_serves_only_its_team(self, member_setup, submit, make_executor):
        alice, bob, a, b, shared = member_setup
        alices = submit(alice, a)
        bobs = submit(bob, b)
        shared.enabled = False
        shared.save()
        make_executor("b-box", models=["m"], team=b)
        batch = job_claim(worker="w", limit=5)
        assert claimed_ids(batch) == [bobs.pk]
        assert Job.objects.get(pk=alices.pk).status == "queued"

    def test_class_and_memory_requirements(self, member_setup, submit, make_executor):
        alice, _, a, _, shared = member_setup
        shared.capabilities = {"models": ["m"], "class": "cpu", "memory_mb": 4096}
        shared.save()
        gpu = make_executor("gpu", models=["m"])
        gpu.capabilities = {"models": ["m"], "class": "gpu", "memory_mb": 81920}
        gpu.save()
        submit(alice, a, **{"class": "gpu"})
        submit(alice, a, memory_mb=16000)
        submit(alice, a, **{"class": "cpu"})
        placed = [claim.executor.name for claim in job_claim(worker="w", limit=3).claims]
        assert placed == ["gpu", "gpu", "shared"]


class TestOnlyTheseJobs:
    """`only`: an API process claims the calls it holds only when the claim would take them anyway
    (scheduler/gateway/onehop.py)."""

    def test_the_job_at_the_head_of_the_order_is_taken(self, member_setup, submit):
        alice, _, a, _, executor = member_setup
        job = submit(alice, a)
        (claim,) = job_claim(worker="api:h:1", limit=1, only={job.pk}).claims
        job.refresh_from_db()
        assert (claim.job.pk, job.status, job.worker, job.executor) == (job.pk, "running", "api:h:1", executor)
        assert list(job.events.values_list("event", flat=True)) == ["queued", "placed", "started"]

    def test_a_job_behind_another_that_would_go_first_is_not_taken_nor_is_the_other(self, member_setup, submit):
        # Given bob's job, which fair share puts first (alice's team is busy), and alice's call...
        alice, bob, a, b, _ = member_setup
        submit(alice, a)
        job_claim(worker="w", limit=1)
        ahead = submit(bob, b, priority=1)
        mine = submit(alice, a)
        # When alice's API process claims only her call, nothing is taken: the slot is bob's job's.
        batch = job_claim(worker="api:h:1", limit=1, only={mine.pk})
        assert batch.claims == []
        assert set(Job.objects.filter(pk__in=[ahead.pk, mine.pk]).values_list("status", flat=True)) == {"queued"}
        # And a worker's claim takes bob's job first, as it would have without the API's try.
        assert claimed_ids(job_claim(worker="w", limit=1)) == [ahead.pk]

    def test_a_capped_team_ahead_is_skipped_as_a_worker_skips_it(self, member_setup, submit):
        alice, bob, a, b, _ = member_setup
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=1)
        submit(alice, a)
        job_claim(worker="w", limit=1)
        capped = submit(alice, a, priority=5)  # first in order, but its team is at its cap
        mine = submit(bob, b)
        assert claimed_ids(job_claim(worker="api:h:1", limit=1, only={mine.pk})) == [mine.pk]
        assert Job.objects.get(pk=capped.pk).status == "queued"

    def test_several_calls_are_taken_while_they_lead_the_order(self, member_setup, submit):
        alice, bob, a, b, _ = member_setup
        first, second = submit(alice, a), submit(bob, b)
        other = submit(alice, a)
        third = submit(bob, b)
        batch = job_claim(worker="api:h:1", limit=3, only={first.pk, second.pk, third.pk})
        # In order: first and second lead; `other` comes next, so third waits behind it.
        assert claimed_ids(batch) == [first.pk, second.pk]
        assert Job.objects.get(pk=third.pk).status == "queued" and Job.objects.get(pk=other.pk).status == "queued"
