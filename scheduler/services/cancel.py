from django.db import transaction

from quotas.budget import quota_settle
from scheduler import signals
from scheduler.locks import lock_job
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.events import event_record
from telemachus.audit import Actor, audit_record
from telemachus.errors import Conflict, NotFound


def job_cancel(*, job_id: int, by: Actor = None) -> Job:
    """End a queued or running job as `canceled`, free its slots and its budget reservation at once.

    Locks the job row (lock level 3). A running job's slots are deleted and its lease cleared in this
    transaction, so the capacity is free for the next claim immediately and the holder's next
    heartbeat, step or finish is refused; on PostgreSQL the holder is also told at commit, so it
    aborts its dispatch without waiting for a heartbeat. A finished job is a 409 conflict. A cancel
    by a person (`by`) is also audited (`job.cancel`)."""
    with transaction.atomic():
        job = lock_job(job_id)
        if job is None:
            raise NotFound(f"Job {job_id} not found.")
        if job.is_terminal:
            raise Conflict(f"Job {job_id} is already {job.status}.", status=job.status)
        was, now, reservation = job.status, job.db_now, job.reservation
        Slot.objects.filter(job=job).delete()
        job.status = Job.Status.CANCELED
        job.finished_at = now
        job.lease = None
        job.lease_expires_at = None
        job.reservation = None
        job.save(update_fields=["status", "finished_at", "lease", "lease_expires_at", "reservation"])
        event_record(
            job=job, event=JobEvent.Type.CANCELED, at=now, was=was,
            by=by.get_username() if by is not None else None,
        )
        if by is not None:
            audit_record(by=by, action="job.cancel", object_type="job", object_id=job.pk, object_repr=str(job),
                         before={"status": was}, after={"status": job.status})
        if was == Job.Status.RUNNING:
            signals.notify_workers(f"{signals.CANCELED}:{job.pk}")
            signals.notify_workers(signals.FREED)
        quota_settle(reservations=[reservation], bills=[], now=now)
    return job
