from dataclasses import dataclass
from typing import Any

from django.db import transaction

from scheduler.core.configuration import queue_policy
from scheduler.core.locks import lock_jobs_expired
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.services.attempts import AttemptEnd, attempts_end
from scheduler.services.events import events_riders, job_event
from scheduler.webhooks import jobs_failed_emit
from telemachus.control import notify
from telemachus.db.changes import rows_save


@dataclass(frozen=True)
class RecoveryReport:
    requeued: list[int]
    failed: list[int]


def jobs_recover(*, limit: int = 500) -> RecoveryReport:
    """Take back jobs whose lease expired (their worker died, hung or lost the database): delete
    their slots and requeue them, or fail them, per the QueuePolicy: `requeue` while attempts are
    below `max_attempts`, else `failed`; `fail` fails at once. A governed slot fails at once: the
    app that held it stopped heartbeating, and no worker could run it. Events `requeued` / `failed`.

    Safe to run from every worker at once: expiry is judged by the database's clock, and rows
    another recoverer holds are skipped (SKIP LOCKED on the job rows, level 3). A worker that
    still runs a recovered job is fenced: its lease is gone, so its finish is refused."""
    record = queue_policy()
    with transaction.atomic(durable=True):
        jobs = lock_jobs_expired(limit=limit)
        if not jobs:
            return RecoveryReport(requeued=[], failed=[])
        # The outcome of an attempt whose worker vanished is unknown: its reservation is released,
        # nothing is billed and fair share is not charged.
        ends = [AttemptEnd.of(job, tokens=None, charge=False) for job in jobs]
        requeued, failed, events = [], [], []
        for job in jobs:
            context: dict[str, Any] = {"worker": job.worker, "attempt": job.attempts, "reason": "lease expired"}
            requeue = record.recovery == QueuePolicy.Recovery.REQUEUE and job.attempts < record.max_attempts
            if requeue and job.type != Job.Type.GOVERNED:
                events.append(job_event(job=job, event=JobEvent.Type.REQUEUED, at=job.db_now, **context))
                job.return_to_queue()
                requeued.append(job)
            else:
                error = (
                    f"lease expired on worker {job.worker!r} after attempt {job.attempts} "
                    f"(recovery={record.recovery}, max_attempts={record.max_attempts})"
                )
                job.end(status=Job.Status.FAILED, at=job.db_now, error=error)
                events.append(job_event(job=job, event=JobEvent.Type.FAILED, at=job.db_now, error=error, **context))
                failed.append(job)
        rows_save(jobs, riders=events_riders(events))
        jobs_failed_emit(jobs=failed)
        if requeued:
            notify.notify_workers(notify.QUEUED)
        attempts_end(ends=ends, now=jobs[0].db_now, record=record, wake=True)
    return RecoveryReport(requeued=[job.pk for job in requeued], failed=[job.pk for job in failed])
