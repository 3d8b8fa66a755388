from decimal import Decimal
from typing import Any

from django.db import transaction

from executors.models import Executor
from executors.tokens import count_prompt_tokens
from quotas.models import money_text
from scheduler.core.configuration import queue_policy
from scheduler.core.locks import lock_job
from scheduler.models import Job, JobEvent
from scheduler.services.attempts import AttemptEnd, attempts_end
from scheduler.services.events import event_record
from telemachus.control import notify
from telemachus.control.audit import Actor, audit_record
from telemachus.db.changes import rows_save
from telemachus.errors import Conflict, NotFound
from telemachus.models import ApiKey


def job_cancel(*, job_id: int, by: Actor = None, reason: str = "", bill: bool = True) -> Job:
    """End a queued or running job as `canceled`, free its slots and its budget reservation at once.

    Locks the job row (lock level 3). A running job's slots are deleted and its lease cleared in this
    transaction, so the capacity is free for the next claim immediately and the holder's next
    heartbeat, step or finish is refused; on PostgreSQL the holder is also told at commit, so it
    aborts its dispatch without waiting for a heartbeat. A finished job is a 409 conflict. A cancel
    by a person (`by`) is also audited (`job.cancel`). `reason` says why, in the job's `error` and
    its `canceled` event (default: canceled by whoever canceled it).

    A running attempt on an executor has already had the model work: the model server's usage of
    an aborted call is never reported back, so the attempt is billed its estimate (the tokens its
    budget reservation held: prompt + max_tokens as submitted, or the prompt's counted tokens when
    the job gave no estimate) and one request, added to `tokens_used`, and what they cost (the
    money its reservation held, else those tokens at the executor's prices), added to `cost`;
    fair share is charged
    the attempt's cost, as a finish would. `bill` False: the caller knows no model call was made
    (a governed slot withdrawn before it was handed out)."""
    with transaction.atomic():
        job = lock_job(job_id)
        if job is None:
            raise NotFound(f"Job {job_id} not found.")
        if job.is_terminal:
            raise Conflict(f"Job {job_id} is already {job.status}.", status=job.status)
        was, now = job.status, job.db_now
        billed = bill and was == Job.Status.RUNNING and job.executor_id is not None
        tokens = _attempt_estimate(job) if billed else 0
        who = by.get_username() if by is not None else None
        end = _attempt_end(job, tokens=tokens) if billed else AttemptEnd.of(job, tokens=None, charge=False)
        job.end(
            status=Job.Status.CANCELED,
            at=now,
            error=reason or (f"canceled by {who}" if who else "canceled"),
            tokens=tokens,
        )
        rows_save([job])
        billing: dict[str, Any] = {"tokens": tokens, "billed": "estimate"} if billed else {}
        if end.cost:
            billing["cost"] = money_text(end.cost)
        event_record(job=job, event=JobEvent.Type.CANCELED, at=now, was=was, by=who, reason=job.error, **billing)
        if by is not None:
            audit_record(
                by=by,
                action="job.cancel",
                object_type="job",
                object_id=job.pk,
                object_repr=str(job),
                before={"status": was},
                after={"status": job.status},
            )
        if was == Job.Status.RUNNING:
            notify.notify_workers(f"{notify.CANCELED}:{job.pk}")
        # Slots, then ledger rows (lock level 4) and team shares (level 5), last.
        attempts_end(ends=[end], now=now, record=queue_policy(), wake=was == Job.Status.RUNNING)
    return job


def key_jobs_cancel(key: ApiKey, by: Actor) -> None:
    """A revoked key's queued jobs are canceled (in the revoking transaction): nothing it asked for
    starts after it was revoked. Its running jobs finish. Locks each job row (level 3), ascending."""
    queued = Job.objects.filter(key=key, status=Job.Status.QUEUED).order_by("pk").values_list("pk", flat=True)
    for job_id in list(queued):
        try:
            job_cancel(job_id=job_id, by=by, reason=f"API key {key.prefix}… was revoked")
        except Conflict:  # it started or ended meanwhile
            continue


def _attempt_end(job: Job, *, tokens: int) -> AttemptEnd:
    """A canceled attempt's end, billed its estimate: the money its reservation held, else its
    billed tokens priced on its executor (the estimate's prompt part at the input price, the rest
    at the output price)."""
    reserved = (job.reservation or {}).get("cost")
    executor = (
        Executor.objects.filter(pk=job.executor_id).only("prices").first()
        if reserved is None and job.executor_id is not None
        else None
    )
    prompt = min(job.est_prompt_tokens, tokens)
    return AttemptEnd.of(
        job,
        tokens=tokens,
        executor=executor,
        prompt_tokens=prompt,
        completion_tokens=tokens - prompt,
        cost=Decimal(reserved) if reserved is not None else None,
    )


def _attempt_estimate(job: Job) -> int:
    """What a canceled attempt is billed: its reservation's tokens, else the job's estimate, else
    the prompt's counted tokens."""
    if job.reservation and job.reservation.get("tokens"):
        return int(job.reservation["tokens"])
    if job.cost_estimate:
        return job.cost_estimate
    messages = (job.input or {}).get("messages")
    return count_prompt_tokens([m for m in messages if isinstance(m, dict)]) if isinstance(messages, list) else 0
