import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction

from quotas.models import money_text
from scheduler.core.bulk import update_rows
from scheduler.core.configuration import configuration, policy_record
from scheduler.core.locks import lock_jobs_to_finish
from scheduler.models import Job, JobEvent
from scheduler.services.attempts import AttemptEnd, attempts_end, slots_free_sent
from scheduler.services.events import events_record, events_riding, job_event
from telemachus.control import notify
from telemachus.control.config import config_at
from telemachus.pipeline import together

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
        finished: list[Job] = []
        retrying: list[dict[str, Any]] = []
        events, refused, ends = [], [], []
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
            meta = {"tokens": outcome.tokens_used, **outcome.meta}
            end = AttemptEnd.of(
                job,
                tokens=outcome.tokens_used or 0,
                executor=executors.get(job.executor_id) if job.executor_id is not None else None,
                prompt_tokens=outcome.meta.get("prompt_tokens"),
                completion_tokens=outcome.meta.get("completion_tokens"),
            )
            ends.append(end)
            if end.cost:
                meta["cost"] = money_text(end.cost)
            if not outcome.ok and outcome.retryable and job.attempts < record.max_attempts:
                delay = retry_delay(attempt=job.attempts, retry_after=outcome.retry_after)
                retrying.append(
                    {
                        "id": job_id,
                        "status": Job.Status.QUEUED,
                        "executor": None,
                        "lease": None,
                        "lease_expires_at": None,
                        "error": outcome.error,
                        "tokens_used": (job.tokens_used or 0) + (outcome.tokens_used or 0),
                        "cost": job.cost,
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
            job.end(
                status=Job.Status.DONE if outcome.ok else Job.Status.FAILED,
                at=job.db_now,
                result=outcome.result,
                error=error,
                tokens=outcome.tokens_used or 0,
            )
            finished.append(job)
            if not outcome.ok:
                meta["error"] = error
            event = JobEvent.Type.FINISHED if outcome.ok else JobEvent.Type.FAILED
            events.append(job_event(job=job, event=event, at=job.db_now, executor=job.executor_id, **meta))
        ended = [{"id": job.pk, **{name: getattr(job, name) for name in Job.END_FIELDS}} for job in finished]
        # The jobs' new states and the slots' DELETE need nothing from each other: one round
        # trip (telemachus/pipeline.py), the server running them in this order.
        with together():
            if ended:
                # The events and their watchers' notice ride on the ends' UPDATE, which returns a
                # row for each job it ends (all of them: they are locked, and held).
                with events_riding(events):
                    update_rows(Job, ended, returning=True)
            update_rows(Job, retrying)
            if retrying and wake_others:
                notify.notify_workers(notify.QUEUED)  # the retries wait in the queue for whoever claims next
            if not ended:
                events_record(events)
            freed = slots_free_sent(job_ids=[end.job.pk for end in ends], wake=wake_others)
        # Slots, then ledger rows (lock level 4) and team shares (level 5), last, with the COMMIT.
        attempts_end(
            ends=ends,
            now=now,
            record=record,
            wake=wake_others,
            rules=configuration(snapshot).rules,
            freed=freed,
            commit=True,
        )
    return FinishReport(
        accepted=[job.pk for job in finished],
        refused=refused,
        retrying=[row["id"] for row in retrying],
        costs={job.pk: job.cost for job in finished},
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
