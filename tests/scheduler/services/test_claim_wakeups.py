"""What the claim tells a worker about waiting: whether work waits for capacity (`backlog`, so freed
slots should wake it) and when something that waits on time becomes claimable (`wake_in`)."""

from datetime import timedelta

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job
from scheduler.services.claim import job_claim

pytestmark = pytest.mark.django_db


class TestBacklog:
    def test_a_full_executor_is_a_backlog(self, member_setup, submit):
        # Given the only executor offering the model at its max_concurrency (4), and a fifth job...
        alice, _, a, _, _ = member_setup
        for _ in range(5):
            submit(alice, a)
        assert len(job_claim(worker="w1", limit=4).claims) == 4

        # When another worker with plenty of room claims...
        batch = job_claim(worker="w2", limit=8)

        # Then it takes nothing but knows work waits for capacity, so a freed slot must wake it.
        assert batch.claims == [] and batch.backlog is True

    def test_room_everywhere_and_nothing_queued_is_no_backlog(self, member_setup, submit):
        alice, _, a, _, _ = member_setup
        submit(alice, a)
        batch = job_claim(worker="w", limit=8)
        assert len(batch.claims) == 1 and batch.backlog is False and batch.wake_in is None


class TestWakeIn:
    def test_a_retry_in_backoff(self, member_setup, submit):
        # Given a job waiting out a retry's backoff for about 30 s...
        alice, _, a, _, _ = member_setup
        job = submit(alice, a)
        Job.objects.filter(pk=job.pk).update(run_after=Now() + timedelta(seconds=30))

        # When a worker claims, it is told when to come back for it.
        batch = job_claim(worker="w", limit=4)
        assert batch.claims == []
        assert 25 < batch.wake_in <= 30

    def test_the_earliest_moment_wins(self, member_setup, submit):
        alice, _, a, _, _ = member_setup
        later, sooner = submit(alice, a), submit(alice, a)
        Job.objects.filter(pk=later.pk).update(run_after=Now() + timedelta(seconds=60))
        Job.objects.filter(pk=sooner.pk).update(run_after=Now() + timedelta(seconds=10))
        assert 5 < job_claim(worker="w", limit=4).wake_in <= 10

    def test_a_breaker_cooling_down(self, member_setup, submit):
        # Given the only executor's breaker open for 20 s more...
        alice, _, a, _, shared = member_setup
        submit(alice, a)
        Executor.objects.filter(pk=shared.pk).update(
            breaker=Executor.Breaker.OPEN, breaker_until=timezone.now() + timedelta(seconds=20)
        )

        batch = job_claim(worker="w", limit=4)

        # Then nothing is placed, and the worker is told to come back when the trial may start.
        assert batch.claims == []
        assert 15 < batch.wake_in <= 21  # the cooldown was set by this clock, the claim reads the database's

    def test_an_exhausted_budget_wakes_at_its_window_reset(self, member_setup, submit):
        # Given team a's minute budget of requests used up by one running job...
        alice, _, a, _, _ = member_setup
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.requests", limit=1, window="minute")
        submit(alice, a)
        submit(alice, a)
        assert len(job_claim(worker="w", limit=1).claims) == 1

        batch = job_claim(worker="w", limit=4)

        # Then the second waits for the window to reset, at most a minute from now.
        assert batch.claims == []
        assert 0 <= batch.wake_in <= 60

    def test_nothing_waits_on_time(self, member_setup, submit):
        alice, _, a, _, _ = member_setup
        submit(alice, a)
        assert job_claim(worker="w", limit=4).wake_in is None

    def test_a_full_batch_names_no_moment(self, member_setup, submit):
        # A worker whose claim filled its room claims again at once; the moment does not matter.
        alice, _, a, _, _ = member_setup
        waiting = submit(alice, a)
        Job.objects.filter(pk=waiting.pk).update(run_after=Now() + timedelta(seconds=30))
        submit(alice, a)
        batch = job_claim(worker="w", limit=1)
        assert len(batch.claims) == 1 and batch.wake_in is None
