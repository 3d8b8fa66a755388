import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from scheduler import signals
from scheduler.bulk import update_rows
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.events import events_record, job_event


@dataclass(frozen=True)
class Outcome:
    """The end of one dispatch, as reported by the worker that holds `lease`."""

    job_id: int
    lease: uuid.UUID
    ok: bool
    result: dict[str, Any] | None = None
    error: str = ""
    tokens_used: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FinishReport:
    accepted: list[int]
    refused: list[int]


def jobs_finish(*, outcomes: Sequence[Outcome]) -> FinishReport:
    """Write the results of finished dispatches: status done or failed, result, tokens, and the
    matching event; free their slots. Batched so a busy worker writes many results per commit.

    Fencing: a result is accepted only from the live holder of the job's lease, that is when the
    job is still running under the same lease and the lease has not expired by the database's
    clock. Anything else (lease expired, job recovered, canceled, or finished by someone else) is
    refused and recorded as a `finish_refused` event; the job is left as it is, so a job completes
    exactly once. Locks the job rows in ascending id (level 2). Durable: not inside another
    transaction."""
    if not outcomes:
        return FinishReport(accepted=[], refused=[])
    by_job = {outcome.job_id: outcome for outcome in outcomes}
    with transaction.atomic(durable=True):
        held = {
            row.pk: row
            for row in Job.objects.select_for_update()
            .filter(pk__in=sorted(by_job))
            .annotate(db_now=Now())
            .order_by("pk")
            .only("pk", "status", "lease", "lease_expires_at", "executor_id", "tokens_used", "worker")
        }
        finished, events, refused = [], [], []
        for job_id, outcome in by_job.items():
            job = held.get(job_id)
            reason = _refusal(job, outcome)
            if reason is not None:
                refused.append(job_id)
                if job is not None:
                    events.append(job_event(job=job, event=JobEvent.Type.FINISH_REFUSED, at=job.db_now,
                                            reason=reason, worker_ok=outcome.ok))
                continue
            finished.append({
                "id": job_id,
                "status": Job.Status.DONE if outcome.ok else Job.Status.FAILED,
                "result": outcome.result,
                "error": outcome.error,
                "tokens_used": (job.tokens_used or 0) + (outcome.tokens_used or 0),
                "finished_at": job.db_now,
                "lease": None,
                "lease_expires_at": None,
            })
            meta = {"tokens": outcome.tokens_used, **outcome.meta}
            if not outcome.ok:
                meta["error"] = outcome.error
            event = JobEvent.Type.FINISHED if outcome.ok else JobEvent.Type.FAILED
            events.append(job_event(job=job, event=event, at=job.db_now, executor=job.executor_id, **meta))
        if finished:
            Slot.objects.filter(job_id__in=[row["id"] for row in finished]).delete()
            update_rows(Job, finished)
            signals.notify_workers(signals.FREED)
        events_record(events)
    return FinishReport(accepted=[row["id"] for row in finished], refused=refused)


def _refusal(job: Job | None, outcome: Outcome) -> str | None:
    if job is None:
        return "job no longer exists"
    if job.lease != outcome.lease:
        return "lease lost" if job.status == Job.Status.RUNNING else f"job is {job.status}"
    if job.status != Job.Status.RUNNING:
        return f"job is {job.status}"
    if job.lease_expires_at <= job.db_now:
        return "lease expired"
    return None


def job_finish(
    *, job_id: int, lease: uuid.UUID, result: dict[str, Any] | None = None, error: str = "", tokens_used: int | None = None
) -> bool:
    """Finish one job (done with `result`, or failed with `error`); True if the write was accepted."""
    outcome = Outcome(job_id=job_id, lease=lease, ok=not error, result=result, error=error, tokens_used=tokens_used)
    return job_id in jobs_finish(outcomes=[outcome]).accepted
