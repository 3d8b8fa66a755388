"""Finish, heartbeat, release, recovery and cancel: the life of a claimed job."""

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, job_finish, jobs_finish, retry_delay
from scheduler.services.lease import jobs_release, leases_renew
from scheduler.services.recover import jobs_recover
from telemachus.errors import Conflict

pytestmark = pytest.mark.django_db


@pytest.fixture
def running(member_setup, submit):
    """Given a job of alice's, claimed by worker w1."""
    alice, _, a, _, _ = member_setup
    submit(alice, a)
    (claim,) = job_claim(worker="w1", limit=1).claims
    return claim


def expire(job_id: int) -> None:
    Job.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def events(job_id: int) -> list[str]:
    return list(JobEvent.objects.filter(job_id=job_id).values_list("event", flat=True))


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


class TestLeases:
    def test_renew_extends_live_leases(self, running):
        Job.objects.filter(pk=running.job.pk).update(lease_expires_at=timezone.now() + timedelta(seconds=2))
        assert leases_renew(held={running.job.pk: running.lease}) == {running.job.pk}
        remaining = Job.objects.get(pk=running.job.pk).lease_expires_at - timezone.now()
        assert remaining > timedelta(seconds=25)

    def test_expired_lease_is_not_revived(self, running):
        expire(running.job.pk)
        assert leases_renew(held={running.job.pk: running.lease}) == set()
        assert Job.objects.get(pk=running.job.pk).lease_expires_at < timezone.now()

    def test_canceled_job_lease_is_lost(self, running):
        job_cancel(job_id=running.job.pk)
        assert leases_renew(held={running.job.pk: running.lease}) == set()

    def test_release_gives_the_job_back(self, running):
        assert jobs_release(held={running.job.pk: running.lease}, reason="worker w1 shut down") == [running.job.pk]
        job = Job.objects.get(pk=running.job.pk)
        assert (job.status, job.attempts, job.lease, job.executor) == ("queued", 0, None, None)
        assert not Slot.objects.exists()
        assert JobEvent.objects.get(job=job, event="requeued").meta["reason"] == "worker w1 shut down"
        assert job_claim(worker="w2", limit=1).claims[0].job.pk == job.pk


class TestRecover:
    def test_expired_job_is_requeued_then_claimed_again(self, running):
        expire(running.job.pk)
        report = jobs_recover()
        assert report.requeued == [running.job.pk] and report.failed == []
        job = Job.objects.get(pk=running.job.pk)
        assert job.status == "queued" and job.lease is None and not Slot.objects.exists()
        assert JobEvent.objects.get(job=job, event="requeued").meta == {
            "worker": "w1",
            "attempt": 1,
            "reason": "lease expired",
        }
        (again,) = job_claim(worker="w2", limit=1).claims
        assert again.job.pk == job.pk and again.job.attempts == 2

    def test_live_leases_are_left_alone(self, running):
        assert jobs_recover() == type(jobs_recover())(requeued=[], failed=[])
        assert Job.objects.get(pk=running.job.pk).status == "running"

    def test_fails_after_max_attempts(self, running):
        QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 1})
        expire(running.job.pk)
        assert jobs_recover().failed == [running.job.pk]
        job = Job.objects.get(pk=running.job.pk)
        assert job.status == "failed" and "lease expired on worker 'w1' after attempt 1" in job.error
        assert not Slot.objects.exists()

    def test_recovery_rule_fail(self, running):
        QueuePolicy.objects.update_or_create(pk=1, defaults={"recovery": "fail"})
        expire(running.job.pk)
        assert jobs_recover().failed == [running.job.pk]

    def test_late_finish_after_recovery_is_refused(self, running):
        expire(running.job.pk)
        jobs_recover()
        (again,) = job_claim(worker="w2", limit=1).claims
        assert not job_finish(job_id=running.job.pk, lease=running.lease, result={"from": "w1"})
        assert job_finish(job_id=again.job.pk, lease=again.lease, result={"from": "w2"})
        assert Job.objects.get(pk=running.job.pk).result == {"from": "w2"}


class TestCancelRunning:
    def test_frees_the_slot_at_once(self, running):
        job = job_cancel(job_id=running.job.pk)
        assert job.status == "canceled" and job.lease is None
        assert not Slot.objects.exists()
        assert JobEvent.objects.get(job=job, event="canceled").meta["was"] == "running"

    def test_cancel_of_finished_job_conflicts(self, running):
        job_finish(job_id=running.job.pk, lease=running.lease, result={})
        with pytest.raises(Conflict):
            job_cancel(job_id=running.job.pk)


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
