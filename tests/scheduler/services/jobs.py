"""Helpers for the tests of a claimed job's life (finish, lease, recover, cancel)."""

from datetime import timedelta

from django.utils import timezone

from scheduler.models import Job, JobEvent


def expire(job_id: int) -> None:
    """The job's lease ran out a second ago."""
    Job.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def events(job_id: int) -> list[str]:
    return list(JobEvent.objects.filter(job_id=job_id).values_list("event", flat=True))
