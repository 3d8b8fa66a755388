"""Slots for the steps of a running job. A flow holds a slot only while a step runs: it acquires one
before each model call and releases it after, so other jobs run between its rounds."""

import uuid
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from executors.health import breaker_trial_started
from executors.models import Executor
from quotas.budget import Bill, quota_settle
from scheduler import signals
from scheduler.locks import lock_claim
from scheduler.models import Job, JobEvent, Slot
from scheduler.policy import policy_for
from scheduler.services.events import event_record
from scheduler.state import ClaimState
from telemachus.errors import Conflict


class LeaseLost(Conflict):
    """The caller no longer holds the job: it must stop working on it."""

    default_detail = "The job's lease is no longer held by this worker."


@dataclass(frozen=True)
class StepSlot:
    slot_id: int
    executor: Executor


def _held_job(job_id: int, lease: uuid.UUID) -> Job:
    job = (
        Job.objects.select_for_update()
        .filter(pk=job_id, lease=lease, status=Job.Status.RUNNING, lease_expires_at__gt=Now())
        .annotate(db_now=Now())
        .first()
    )
    if job is None:
        raise LeaseLost(f"Lease {lease} no longer holds job {job_id}.")
    return job


def slot_acquire(*, job_id: int, lease: uuid.UUID, worker: str) -> StepSlot | None:
    """A slot for the next step of a running job, under the same four caps and placement as the
    claim; None when no slot is free now (the caller waits and retries). Raises LeaseLost when
    `lease` no longer holds the job. Locks the claim lock (level 1), then the job (level 3)."""
    with transaction.atomic(durable=True):
        record, now = lock_claim()
        job = _held_job(job_id, lease)
        state = ClaimState.load(policy=record, now=now)
        view = policy_for(record).place(job, state.candidates(job)) if state.fits(job) else None
        if view is None:
            return None
        if view.trial:
            breaker_trial_started(executor=view.executor, now=now)
        slot = Slot.objects.create(
            job=job, executor=view.executor, team_id=job.team_id, user_id=job.user_id, worker=worker, acquired_at=now
        )
        event_record(job=job, event=JobEvent.Type.STEP, at=now, executor=view.pk, action="acquired", slot=slot.pk)
    return StepSlot(slot_id=slot.pk, executor=view.executor)


def slot_release(*, slot_id: int, job_id: int, lease: uuid.UUID, tokens_used: int = 0, **step: Any) -> None:
    """Free a step's slot in the transaction that records the step (tokens billed to the job and to
    its budgets, a `step` event). Raises LeaseLost when `lease` no longer holds the job; in that case its slots
    were already freed by whoever took the job away. Locks the job (level 3)."""
    with transaction.atomic(durable=True):
        job = _held_job(job_id, lease)
        slot = Slot.objects.filter(pk=slot_id, job=job).values_list("executor_id", flat=True).first()
        deleted, _ = Slot.objects.filter(pk=slot_id, job=job).delete()
        if tokens_used:
            job.tokens_used = (job.tokens_used or 0) + tokens_used
            job.save(update_fields=["tokens_used"])
        event_record(
            job=job, event=JobEvent.Type.STEP, at=job.db_now, action="released", slot=slot_id,
            tokens=tokens_used, held=bool(deleted), **step,
        )
        signals.notify_workers(signals.FREED)
        # Every round is a dispatch: billed like a finished job (ledger rows last, lock level 4).
        quota_settle(reservations=[], now=job.db_now,
                     bills=[Bill(team_id=job.team_id, user_id=job.user_id, executor_id=slot, tokens=tokens_used)])
