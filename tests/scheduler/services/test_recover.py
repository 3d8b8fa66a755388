"""Recovery: a job whose lease expired goes back to the queue (or fails, out of attempts), and the
lease that lost it can no longer write."""

import pytest

from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.recover import jobs_recover
from tests.scheduler.services.jobs import expire

pytestmark = pytest.mark.django_db


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
