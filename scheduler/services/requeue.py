from django.db import transaction

from scheduler.core.locks import lock_job
from scheduler.models import Job, JobEvent
from scheduler.services.events import event_record
from telemachus.control import notify
from telemachus.control.audit import audit_record
from telemachus.db.changes import rows_save
from telemachus.errors import Conflict, NotFound
from telemachus.teams import rbac

REQUEUEABLE = (Job.Status.FAILED, Job.Status.CANCELED)


def job_requeue(*, job_id: int, by: rbac.Principal) -> Job:
    """An operator sends a failed or canceled job back to the queue, once whatever failed it is
    fixed: a fresh start with its attempts reset and its result and error cleared (a flow starts
    again from its input's messages, at round 1). Its events (and
    the tokens it used, which were billed) stay. It keeps its place by age, bypasses the depth cap
    (an operator's decision), and still meets caps and budgets at the claim like any queued job.

    Audited (`job.requeue`). Locks the job row (level 3). A queued, running or done job is a 409 conflict: cancel a
    running job first; submit a done one again."""
    rbac.require_operator(by)
    with transaction.atomic():
        job = lock_job(job_id)
        if job is None:
            raise NotFound(f"Job {job_id} not found.")
        if job.status not in REQUEUEABLE:
            raise Conflict(
                f"Job {job_id} is {job.status}; only failed or canceled jobs can be requeued.", status=job.status
            )
        if job.body_removed_at is not None:
            raise Conflict(f"Job {job_id} lost its input to body retention; submit it again.", status=job.status)
        was = job.status
        job.requeue_fresh()
        rows_save([job])
        event_record(
            job=job, event=JobEvent.Type.REQUEUED, at=job.db_now, reason="operator", was=was, by=by.get_username()
        )
        audit_record(
            by=by,
            action="job.requeue",
            object_type="job",
            object_id=job.pk,
            object_repr=str(job),
            before={"status": was},
            after={"status": job.status},
        )
        notify.notify_workers(notify.QUEUED)
    return job
