import random
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction
from django.db.models import OuterRef, Subquery
from django.db.models.functions import Now

from quotas.budget import Bill, quota_settle
from scheduler.core.bulk import update_rows
from scheduler.core.configuration import configuration, policy_record
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.notify import channels as signals
from scheduler.services.events import events_record, job_event
from scheduler.services.shares import team_shares_charge
from telemachus.control.config import config_at, version_annotation

if TYPE_CHECKING:
    from scheduler.core.locks import ClockedJob


@dataclass(frozen=True)
class Outcome:
    """The end of one dispatch, as reported by the worker that holds `lease`."""

    job_id: int
    lease: uuid.UUID
    ok: bool
    result: dict[str, Any] | None = None
    error: str = ""
    tokens_used: int | None = None
    # For a failure: may another attempt succeed (possibly elsewhere), and after how long at least.
    retryable: bool = False
    retry_after: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FinishReport:
    accepted: list[int]
    refused: list[int]
    retrying: list[int] = field(default_factory=list)


def retry_delay(*, attempt: int, retry_after: float | None) -> float:
    """Exponential backoff with full jitter (so retries of a burst spread out instead of arriving
    together), never sooner than the server's Retry-After."""
    cap = min(settings.TELEMACHUS_RETRY_MAX_SECONDS, settings.TELEMACHUS_RETRY_BASE_SECONDS * 2 ** max(attempt - 1, 0))
    delay = random.uniform(cap / 2, cap)
    return max(delay, retry_after or 0.0)


def jobs_finish(*, outcomes: Sequence[Outcome], wake_others: bool = True) -> FinishReport:
    """Write the results of finished dispatches: status done or failed, result, tokens, and the
    matching event; free their slots. Batched so a busy worker writes many results per commit.

    A retryable failure with attempts left (QueuePolicy.max_attempts) goes back to the queue
    instead, to run after a jittered exponential backoff (never sooner than Retry-After),
    preferably on another executor: event `retry_scheduled`.

    Fencing: a result is accepted only from the live holder of the job's lease, that is when the
    job is still running under the same lease and the lease has not expired by the database's
    clock. Anything else (lease expired, job recovered, canceled, or finished by someone else) is
    refused and recorded as a `finish_refused` event; the job is left as it is, so a job completes
    exactly once. Locks the job rows in ascending id (level 3). Durable: not inside another
    transaction.

    Freed slots wake the workers (`freed`), unless `wake_others` is False: a worker finishing its
    own jobs claims again itself, with the local room the finished jobs left, so waking every
    other worker would only have them race it for the same slots."""
    if not outcomes:
        return FinishReport(accepted=[], refused=[])
    by_job = {outcome.job_id: outcome for outcome in outcomes}
    with transaction.atomic(durable=True):
        held = {
            row.pk: row
            for row in Job.objects.select_for_update(of=("self",))
            .filter(pk__in=sorted(by_job))
            .annotate(db_now=Now(), config_version=version_annotation(), attempt_started_at=attempt_start())
            .order_by("pk")
            .only(
                "pk",
                "status",
                "lease",
                "lease_expires_at",
                "executor_id",
                "tokens_used",
                "worker",
                "attempts",
                "team_id",
                "user_id",
                "reservation",
                "started_at",
                "cost_estimate",
            )
        }
        if not held:
            return FinishReport(accepted=[], refused=sorted(by_job))
        first = next(iter(held.values()))
        now, snapshot = first.db_now, config_at(first.config_version)
        record = policy_record(snapshot)
        max_attempts = record.max_attempts
        finished: list[dict[str, Any]] = []
        retrying: list[dict[str, Any]] = []
        events, refused, bills, charges = [], [], [], defaultdict[int, float](float)
        for job_id, outcome in by_job.items():
            job = held.get(job_id)
            reason = _refusal(job, outcome)
            if reason is not None or job is None:
                refused.append(job_id)
                if job is not None:
                    events.append(
                        job_event(
                            job=job,
                            event=JobEvent.Type.FINISH_REFUSED,
                            at=job.db_now,
                            reason=reason,
                            worker_ok=outcome.ok,
                        )
                    )
                continue
            tokens = (job.tokens_used or 0) + (outcome.tokens_used or 0)
            meta = {"tokens": outcome.tokens_used, **outcome.meta}
            bills.append(
                Bill(
                    team_id=job.team_id,
                    user_id=job.user_id,
                    executor_id=job.executor_id,
                    tokens=outcome.tokens_used or 0,
                )
            )
            if job.executor_id is not None:  # a tool job held no executor slot: nothing to charge
                charges[job.team_id] += attempt_cost(
                    record,
                    started_at=job.attempt_started_at or now,
                    now=now,
                    tokens=outcome.tokens_used or 0,
                    estimate=job.cost_estimate,
                )
            if not outcome.ok and outcome.retryable and job.attempts < max_attempts:
                delay = retry_delay(attempt=job.attempts, retry_after=outcome.retry_after)
                retrying.append(
                    {
                        "id": job_id,
                        "status": Job.Status.QUEUED,
                        "executor": None,
                        "lease": None,
                        "lease_expires_at": None,
                        "error": outcome.error,
                        "tokens_used": tokens,
                        "run_after": job.db_now + timedelta(seconds=delay),
                        "avoid_executor": job.executor_id,
                        "reservation": None,
                    }
                )
                events.append(
                    job_event(
                        job=job,
                        event=JobEvent.Type.RETRY_SCHEDULED,
                        at=job.db_now,
                        executor=job.executor_id,
                        error=outcome.error,
                        attempt=job.attempts,
                        delay_s=round(delay, 3),
                        **meta,
                    )
                )
                continue
            error = outcome.error
            if not outcome.ok and outcome.retryable:
                error = f"{error} (gave up after {job.attempts} attempts)"
            finished.append(
                {
                    "id": job_id,
                    "status": Job.Status.DONE if outcome.ok else Job.Status.FAILED,
                    "result": outcome.result,
                    "error": error,
                    "tokens_used": tokens,
                    "finished_at": job.db_now,
                    "lease": None,
                    "lease_expires_at": None,
                    "reservation": None,
                }
            )
            if not outcome.ok:
                meta["error"] = error
            event = JobEvent.Type.FINISHED if outcome.ok else JobEvent.Type.FAILED
            events.append(job_event(job=job, event=event, at=job.db_now, executor=job.executor_id, **meta))
        ended = [row["id"] for row in finished + retrying]
        if ended:
            Slot.objects.filter(job_id__in=ended).delete()
            update_rows(Job, finished)
            update_rows(Job, retrying)
            if wake_others:
                signals.notify_workers(signals.FREED)
        events_record(events)
        # Ledger rows last (lock level 4).
        quota_settle(
            reservations=[held[row["id"]].reservation for row in finished + retrying],
            bills=bills,
            now=now,
            rules=configuration(snapshot).rules,
        )
        # What the attempts cost, for fair share (lock level 5, the last).
        team_shares_charge(charges=charges, now=now, half_life=record.half_life_seconds)
    return FinishReport(
        accepted=[row["id"] for row in finished], refused=refused, retrying=[row["id"] for row in retrying]
    )


def attempt_start() -> Subquery:
    """The start of a running job's attempt (or round): its slot's `acquired_at`. `Job.started_at`
    is when the job first started, which for a retry or a flow's later round is long before."""
    return Subquery(Slot.objects.filter(job=OuterRef("pk")).order_by("id").values("acquired_at")[:1])


def attempt_began(job: Job) -> datetime | None:
    """`attempt_start` for one job already locked, read before its slot is deleted; None when it
    holds no slot (a tool job)."""
    return Slot.objects.filter(job=job).order_by("id").values_list("acquired_at", flat=True).first()


def attempt_cost(
    record: QueuePolicy, *, started_at: datetime | None, now: datetime, tokens: int, estimate: int
) -> float:
    """What an attempt adds to its team's fair-share usage when it ends: its real cost (slot-seconds
    or tokens) less the entry penalty charged when it started. The penalty only holds a burst back
    until the real cost is known; history keeps the real cost alone."""
    if record.cost == QueuePolicy.Cost.TOKENS:
        return tokens - estimate
    return max((now - (started_at or now)).total_seconds(), 0.0) - float(record.entry_penalty)


def _refusal(job: "ClockedJob | None", outcome: Outcome) -> str | None:
    if job is None:
        return "job no longer exists"
    if job.lease != outcome.lease:
        return "lease lost" if job.status == Job.Status.RUNNING else f"job is {job.status}"
    if job.status != Job.Status.RUNNING:
        return f"job is {job.status}"
    if job.lease_expires_at is None or job.lease_expires_at <= job.db_now:
        return "lease expired"
    return None


def job_finish(
    *,
    job_id: int,
    lease: uuid.UUID,
    result: dict[str, Any] | None = None,
    error: str = "",
    tokens_used: int | None = None,
) -> bool:
    """Finish one job (done with `result`, or failed with `error`); True if the write was accepted."""
    outcome = Outcome(job_id=job_id, lease=lease, ok=not error, result=result, error=error, tokens_used=tokens_used)
    return job_id in jobs_finish(outcomes=[outcome]).accepted
