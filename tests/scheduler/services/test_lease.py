"""Leases: a worker's heartbeat renews what it holds; a worker that stops hands its jobs back."""

from datetime import timedelta

import pytest
from django.utils import timezone

from scheduler.models import Job, JobEvent, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.lease import jobs_release, leases_renew
from tests.scheduler.services.jobs import expire

pytestmark = pytest.mark.django_db


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
