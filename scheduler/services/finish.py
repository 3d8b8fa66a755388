import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction

from executors.models import Executor
from quotas.models import money_text
from scheduler.core.configuration import configuration, policy_record
from scheduler.core.locks import lock_jobs_to_finish
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.services.attempts import AttemptEnd, attempts_end, slots_free_sent
from scheduler.services.events import events_riders, job_event
from scheduler.services.routes import FAILED
from scheduler.webhooks import jobs_failed_emit
from telemachus.control import notify
from telemachus.control.config import config_at
from telemachus.db.changes import rows_save
from telemachus.db.pipeline import together

if TYPE_CHECKING:
    from scheduler.core.locks import ClockedJob, FinishedJob


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
    # What each accepted job cost in all (its attempts so far), for an answer made from the
    # report without reading the job again (scheduler/gateway/onehop.py).
    costs: dict[int, Decimal] = field(default_factory=dict)
    # Executors of the jobs it finished or requeued whose breaker it saw closed with no failure
    # counted, for the breaker's report (executors/health.py `breaker_record`, `clean`).
    clean: frozenset[int] = frozenset()


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

    Freed slots wake the workers (`freed`, and `queued` for retries), unless `wake_others` is
    False: a worker finishing its own jobs claims again itself, with the local room the finished
    jobs left, so waking every other worker would only have them race it for the same slots."""
    if not outcomes:
        return FinishReport(accepted=[], refused=[])
    by_job = {outcome.job_id: outcome for outcome in outcomes}
    with transaction.atomic(durable=True):
        held = {job.pk: job for job in lock_jobs_to_finish(sorted(by_job))}
        if not held:
            return FinishReport(accepted=[], refused=sorted(by_job))
        first = next(iter(held.values()))
        now, snapshot = first.db_now, config_at(first.config_version)
        record = policy_record(snapshot)
        executors = {e.pk: e for e in configuration(snapshot).executors}
        written = _Written()
        for job_id, outcome in by_job.items():
            _outcome_apply(held.get(job_id), outcome, job_id=job_id, record=record, executors=executors, into=written)
        jobs_failed_emit(jobs=written.finished)
        # The jobs' new states and the slots' DELETE need nothing from each other: one round
        # trip (telemachus/db/pipeline.py), the server running them in this order. The events
        # and their watchers' notice ride on the first of the jobs' UPDATEs.
        with together():
            rows_save([*written.finished, *written.retrying], riders=events_riders(written.events))
            if written.retrying and wake_others:
                notify.notify_workers(notify.QUEUED)  # the retries wait in the queue for whoever claims next
            freed = slots_free_sent(job_ids=[end.job.pk for end in written.ends], wake=wake_others)
        # Slots, then ledger rows (lock level 4) and team shares (level 5), last, with the COMMIT.
        attempts_end(
            ends=written.ends,
            now=now,
            record=record,
            wake=wake_others,
            rules=configuration(snapshot).rules,
            freed=freed,
            commit=True,
        )
    refused = set(written.refused)
    return FinishReport(
        accepted=[job.pk for job in written.finished],
        refused=written.refused,
        retrying=[job.pk for job in written.retrying],
        costs={job.pk: job.cost for job in written.finished},
        clean=frozenset(
            executor.pk
            for job_id, job in held.items()
            if job_id not in refused
            and job.executor_failures == 0
            and job.executor_id is not None
            and (executor := executors.get(job.executor_id)) is not None
            and executor.breaker == executor.Breaker.CLOSED
        ),
    )


@dataclass
class _Written:
    """What a finish writes: the jobs it ends and those it sends back to retry, their attempts'
    ends, their events, and the outcomes it refused."""

    finished: list[Job] = field(default_factory=list)
    retrying: list[Job] = field(default_factory=list)
    ends: list[AttemptEnd] = field(default_factory=list)
    events: list[JobEvent] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)


def _outcome_apply(
    job: "FinishedJob | None",
    outcome: Outcome,
    *,
    job_id: int,
    record: QueuePolicy,
    executors: dict[int, Executor],
    into: _Written,
) -> None:
    """One outcome, against its locked job: refused (not from the lease's live holder), a retry
    (a retryable failure with attempts left: after a jittered exponential backoff, never sooner
    than Retry-After, preferably on another executor), a fallback (a job on a model route that
    failed after its retries with a retryable error: queued on the route's next model), or the
    job's end."""
    reason = _refusal(job, outcome)
    if reason is not None or job is None:
        into.refused.append(job_id)
        if job is not None:
            into.events.append(
                job_event(
                    job=job, event=JobEvent.Type.FINISH_REFUSED, at=job.db_now, reason=reason, worker_ok=outcome.ok
                )
            )
        return
    meta = {"tokens": outcome.tokens_used, **outcome.meta}
    end = AttemptEnd.of(
        job,
        tokens=outcome.tokens_used or 0,
        executor=executors.get(job.executor_id) if job.executor_id is not None else None,
        prompt_tokens=outcome.meta.get("prompt_tokens"),
        completion_tokens=outcome.meta.get("completion_tokens"),
    )
    into.ends.append(end)
    if end.cost:
        meta["cost"] = money_text(end.cost)
    if not outcome.ok and outcome.retryable and job.attempts < record.max_attempts:
        delay = retry_delay(attempt=job.attempts, retry_after=outcome.retry_after)
        failed_on, attempt = job.executor_id, job.attempts
        job.retry(after=job.db_now + timedelta(seconds=delay), error=outcome.error, tokens=outcome.tokens_used or 0)
        into.retrying.append(job)
        into.events.append(
            job_event(
                job=job,
                event=JobEvent.Type.RETRY_SCHEDULED,
                at=job.db_now,
                executor=failed_on,
                error=outcome.error,
                attempt=attempt,
                delay_s=round(delay, 3),
                **meta,
            )
        )
        return
    error = outcome.error
    if not outcome.ok and outcome.retryable:
        error = f"{error} (gave up after {job.attempts} attempts)"
        target = job.next_model()
        if target is not None:  # a route's next model takes it (scheduler/services/routes.py)
            failed_on, before = job.executor_id, job.model
            job.fall_back(model=target, now=job.db_now, error=error, tokens=outcome.tokens_used or 0)
            into.retrying.append(job)
            details = {"from": before, "to": target, "reason": FAILED, **meta, "error": error}
            into.events.append(
                job_event(job=job, event=JobEvent.Type.FELL_BACK, at=job.db_now, executor=failed_on, **details)
            )
            return
    job.end(
        status=Job.Status.DONE if outcome.ok else Job.Status.FAILED,
        at=job.db_now,
        result=outcome.result,
        error=error,
        tokens=outcome.tokens_used or 0,
    )
    into.finished.append(job)
    if not outcome.ok:
        meta["error"] = error
    event = JobEvent.Type.FINISHED if outcome.ok else JobEvent.Type.FAILED
    into.events.append(job_event(job=job, event=event, at=job.db_now, executor=job.executor_id, **meta))


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
