"""Finishing a claimed job: its outcome written once, by the lease that holds it, and the delay
before a retry."""

import uuid

import pytest

from scheduler.models import Job, JobEvent, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, job_finish, jobs_finish, retry_delay
from tests.scheduler.services.jobs import events, expire

pytestmark = pytest.mark.django_db


class TestFinish:
    def test_done(self, running):
        assert job_finish(job_id=running.job.pk, lease=running.lease, result={"text": "hi"}, tokens_used=42)
        job = Job.objects.get(pk=running.job.pk)
        assert (job.status, job.result, job.tokens_used, job.error) == ("done", {"text": "hi"}, 42, "")
        assert job.lease is None and job.finished_at is not None
        assert not Slot.objects.exists()
        assert events(job.pk)[-1] == "finished"

    def test_failed(self, running):
        assert job_finish(job_id=running.job.pk, lease=running.lease, error="upstream 400: bad model")
        job = Job.objects.get(pk=running.job.pk)
        assert (job.status, job.error) == ("failed", "upstream 400: bad model")
        assert JobEvent.objects.get(job=job, event="failed").meta["error"] == "upstream 400: bad model"
        assert not Slot.objects.exists()

    def test_wrong_lease_is_refused_and_recorded(self, running):
        assert not job_finish(job_id=running.job.pk, lease=uuid.uuid4(), result={})
        job = Job.objects.get(pk=running.job.pk)
        assert job.status == "running" and Slot.objects.count() == 1
        assert JobEvent.objects.get(job=job, event="finish_refused").meta["reason"] == "lease lost"

    def test_expired_lease_is_refused_even_before_recovery(self, running):
        expire(running.job.pk)
        assert not job_finish(job_id=running.job.pk, lease=running.lease, result={})
        job = Job.objects.get(pk=running.job.pk)
        assert job.status == "running"
        assert JobEvent.objects.get(job=job, event="finish_refused").meta["reason"] == "lease expired"

    def test_finish_after_cancel_is_refused(self, running):
        job_cancel(job_id=running.job.pk)
        assert not job_finish(job_id=running.job.pk, lease=running.lease, result={})
        job = Job.objects.get(pk=running.job.pk)
        assert job.status == "canceled" and job.result is None
        assert JobEvent.objects.get(job=job, event="finish_refused").meta["reason"] == "job is canceled"

    def test_a_job_completes_once(self, running):
        assert job_finish(job_id=running.job.pk, lease=running.lease, result={"n": 1})
        assert not job_finish(job_id=running.job.pk, lease=running.lease, result={"n": 2})
        assert Job.objects.get(pk=running.job.pk).result == {"n": 1}
        assert events(running.job.pk).count("finished") == 1

    def test_batch_mixes_accepted_and_refused(self, member_setup, submit):
        alice, _, a, _, _ = member_setup
        submit(alice, a)
        submit(alice, a)
        first, second = job_claim(worker="w", limit=2).claims
        report = jobs_finish(
            outcomes=[
                Outcome(job_id=first.job.pk, lease=first.lease, ok=True, result={}),
                Outcome(job_id=second.job.pk, lease=uuid.uuid4(), ok=True, result={}),
            ]
        )
        assert report.accepted == [first.job.pk] and report.refused == [second.job.pk]
        assert list(Slot.objects.values_list("job_id", flat=True)) == [second.job.pk]


class TestRetryDelay:
    def test_doubles_per_attempt_up_to_the_cap_with_full_jitter(self, settings):
        settings.TELEMACHUS_RETRY_BASE_SECONDS, settings.TELEMACHUS_RETRY_MAX_SECONDS = 1, 60
        for attempt, cap in ((1, 1), (2, 2), (3, 4), (6, 32), (7, 60), (30, 60)):
            delays = [retry_delay(attempt=attempt, retry_after=None) for _ in range(200)]
            assert all(cap / 2 <= delay <= cap for delay in delays), attempt
            assert len(set(delays)) > 100, "jittered, so a burst of retries spreads out"

    def test_never_sooner_than_retry_after(self, settings):
        settings.TELEMACHUS_RETRY_BASE_SECONDS, settings.TELEMACHUS_RETRY_MAX_SECONDS = 1, 60
        assert all(retry_delay(attempt=1, retry_after=30) == 30 for _ in range(50))
