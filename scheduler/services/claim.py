import uuid
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Field, JSONField

from executors.health import breaker_trial_started
from executors.models import Executor
from quotas.budget import Account
from scheduler.core.bulk import rows_insert
from scheduler.core.locks import lock_claim
from scheduler.core.policy import policy_for
from scheduler.core.state import ClaimState, ExecutorView
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.events import events_record, events_riding, job_event
from scheduler.services.rounds import round_claimed, round_started_event
from scheduler.services.shares import team_shares_charge
from scheduler.services.tooljobs import tool_jobs_start
from telemachus.control import notify
from telemachus.control.notify import changes_notify
from telemachus.locks import Level, for_update_sql
from telemachus.pipeline import committing

MAX_ORDER_ROUNDS = 3


@dataclass(frozen=True)
class Claim:
    """A job this worker now holds: run it on `executor`, name the job and `lease` in every later
    write. Jobs claimed together share a lease token; the fence is always the pair. A tool job
    has no executor and no slot (services/tooljobs.py)."""

    job: Job
    executor: Executor | None
    slot_id: int | None
    lease: uuid.UUID


@dataclass(frozen=True)
class ClaimBatch:
    claims: list[Claim]
    # True when work may be waiting for capacity (a cap at any scope was reached, an executor is
    # full, or jobs were left behind), so the caller should try again when slots are freed; False
    # when the queue had nothing that more capacity would let start.
    backlog: bool
    # Seconds from the claim until something that waits on time may become claimable: a retry's
    # backoff ends, a breaker's cooldown ends, a budget window resets. None when nothing does (or
    # the claim took all it could, so the caller claims again at once anyway).
    wake_in: float | None = None


def lease_length() -> timedelta:
    return timedelta(seconds=settings.TELEMACHUS_LEASE_SECONDS)


def job_claim(*, worker: str, limit: int = 1, only: Collection[int] | None = None) -> ClaimBatch:
    """Take up to `limit` queued jobs whose four scopes (global, executor, team, user) all have a
    free slot, in the policy's order, and place each on the executor the policy chooses.

    `only` (an API process claiming the calls it holds, scheduler/gateway/onehop.py): take jobs
    of `only` as long as they are what this claim would take anyway, and stop at the first job
    the claim would take that is not one of them, taking it neither. What is taken is then
    exactly what a worker's claim would have taken at this moment, in the same order under the
    same caps; the jobs of `only` left queued wake the workers at commit (their submit did not).
    No tool jobs.

    One short durable transaction. Locks the claim lock (level 1) first, so no other slot can be
    created until commit: the slot counts read under it cannot rise, and no two claims can both
    take the last slot of any scope, on any number of hosts. An executor whose breaker cooldown is
    over moves to half open (level 2) as its trial job is placed. Then locks the chosen job rows (level
    3) with SKIP LOCKED, so a job being canceled at this moment is skipped, not waited for. Writes
    a Slot and a lease per job, marks it running, records `placed` and `started`. Never calls an
    executor: dispatch happens after commit. Then starts queued tool jobs, which need no slot, in
    what is left of `limit`.

    On PostgreSQL the commit does not wait for its WAL to reach the disk (synchronous_commit off
    for this transaction only): a claim lost in a server crash is lost whole, its jobs queued as
    before it, and the finish that would follow is refused by the lease; any later synchronous
    commit flushes it first. The reasoning: docs/gateway.md, "The claim's commit"."""
    with transaction.atomic(durable=True):
        record, now = lock_claim(commit_unflushed=True, counts=True)
        state = ClaimState.load(policy=record, now=now)
        chosen: list[tuple[Job, ExecutorView]] = []
        deferred: dict[int, tuple[Job, Account]] = {}
        passed_over = False
        # A job passed over because a cap filled during this batch may hide others that now fit
        # (a teammate behind a user who just reached their cap): ask the policy again, with the
        # caps as they stand, while each round still makes progress.
        policy = policy_for(record)
        policy.state = state
        taken: set[int] = set()
        head_elsewhere = False  # with `only`: the claim would take a job that is not one of them
        for _ in range(MAX_ORDER_ROUNDS if state.global_free() > 0 else 0):
            taken_before, passed_over = len(chosen), False
            for job in policy.order(state, limit=limit - len(chosen)):
                if job.pk in taken:  # a later round (or a custom policy) may offer a job again
                    continue
                if len(chosen) >= limit or state.global_free() <= 0:
                    passed_over = True
                    break
                account = state.over_budget(job)
                view = policy.place(job, state.candidates(job)) if account is None and state.fits(job) else None
                if view is None:
                    passed_over = True
                    # An empty budget gets one event of its own (below); a job too big for what is
                    # left of a budget gets one of its own.
                    if account is not None and account.remaining > 0:
                        deferred[job.pk] = (job, account)
                    continue
                if only is not None and job.pk not in only:
                    head_elsewhere = passed_over = True
                    break
                state.take(job, view)
                chosen.append((job, view))
                taken.add(job.pk)
            if (
                not passed_over
                or head_elsewhere
                or len(chosen) == taken_before
                or len(chosen) >= limit
                or state.global_free() <= 0
                or not state.room_anywhere()
            ):
                break
        backlog = (
            passed_over
            or len(chosen) >= limit
            or state.global_free() <= 0
            or bool(state.capped_teams() or state.capped_users())
            or state.executor_full()
        )
        wake_at = _next_eligible(state) if len(chosen) < limit else None
        for view in {view.pk: view for _, view in chosen if view.trial}.values():
            breaker_trial_started(executor=view.executor, now=now)
        claims = _start(chosen, worker=worker, state=state) if chosen else []
        told = bool(claims)  # live views were told by the statement that started them
        tools = (
            tool_jobs_start(worker=worker, limit=limit - len(claims), now=now, expires=now + lease_length())
            if record.tools_queued and only is None
            else []
        )
        claims += [_tool_claim(job) for job in tools]
        if only is not None and len(claims) < len(only):
            notify.notify_workers(notify.QUEUED)
        backlog = backlog or len(claims) >= limit
        if claims and not told:
            changes_notify("claimed")  # live dashboards, not workers
        _record_deferrals(list(deferred.values()), now=now)
        # Ledger rows last (lock level 4): the reservations of the jobs actually started, and one
        # `deferred` event for each budget found empty for the first time in its window.
        state.budgets.hold([claim.job.reservation for claim in claims])
        events_record(
            job_event(job=None, event=JobEvent.Type.DEFERRED, at=now, **account.describe())
            for account in state.budgets.note_exhausted()
        )
        # Fair share's entry penalty, last (lock level 5): a burst pays as it starts, before its
        # usage is known, so it cannot take more than its share in the meantime.
        charges: dict[int, float] = defaultdict(float)
        for claim in claims:
            charges[claim.job.team_id] += (
                claim.job.cost_estimate if record.cost == record.Cost.TOKENS else record.entry_penalty
            )
        with committing():  # the last write, whose rows nothing reads, goes with the COMMIT
            team_shares_charge(charges=charges, now=now, half_life=record.half_life_seconds)
        wake_in = max((wake_at - now).total_seconds(), 0.0) if wake_at is not None else None
        return ClaimBatch(claims=claims, backlog=backlog, wake_in=wake_in)


def _next_eligible(state: ClaimState) -> datetime | None:
    """The next moment queued work that waits on time may become claimable: the earliest end of a
    retry's backoff (read with the claim lock), of a breaker's cooldown, or of a budget window
    that refused work or ran out, or of a wait the policy named (a round waiting for its preferred
    executor). A worker sleeps until then instead of polling."""
    moments = [
        *state.cooldown_ends,
        *state.wake_moments,
        state.budgets.next_reset(),
        getattr(state.policy, "next_retry", None),
    ]
    return min(filter(None, moments), default=None)


def _record_deferrals(deferred: list[tuple[Job, Account]], *, now: datetime) -> None:
    """One `deferred` event per job per budget window: a job whose estimate the remaining budget
    cannot cover stays queued until the window resets, and says so once, not on every claim."""
    fresh = [(job, account) for job, account in deferred if job.deferred_until != account.end]
    if not fresh:
        return
    for job, account in fresh:
        Job.objects.filter(pk=job.pk, status=Job.Status.QUEUED).update(deferred_until=account.end)
    events_record(
        job_event(job=job, event=JobEvent.Type.DEFERRED, at=now, estimate=job.cost_estimate, **account.describe())
        for job, account in fresh
    )


def _start(chosen: list[tuple[Job, ExecutorView]], *, worker: str, state: ClaimState) -> list[Claim]:
    """Mark the chosen jobs running under one lease token for this claim (the fencing token is the
    pair job id + lease), then write their slots and events. A job that is no longer queued, or
    that another transaction holds (a cancel at this very moment), is left out, not waited for."""
    now, expires, lease = state.now, state.now + lease_length(), uuid.uuid4()
    payloads = _mark_running(chosen, worker=worker, now=now, expires=expires, lease=lease)
    chosen = [(job, view) for job, view in chosen if job.pk in payloads]
    for job, view in chosen:
        job.status, job.executor, job.worker = Job.Status.RUNNING, view.executor, worker
        job.started_at = job.started_at or now  # a queued row's first start is stable: only a claim sets it
        job.attempts += 1
        job.lease, job.lease_expires_at = lease, expires
        job.input, job.conversation = payloads[job.pk]
    if not chosen:
        return []
    events = []
    for job, view in chosen:
        events.append(job_event(job=job, event=JobEvent.Type.PLACED, at=now, executor=view.pk, attempt=job.attempts))
        events.append(job_event(job=job, event=JobEvent.Type.STARTED, at=now, executor=view.pk, worker=worker))
        if round_claimed(job) is not None:
            # A flow's round starts with its claim: its holder makes no write before the model call.
            events.append(round_started_event(job, at=now))
    slots = [
        Slot(job=job, executor=view.executor, team_id=job.team_id, user_id=job.user_id, worker=worker, acquired_at=now)
        for job, view in chosen
    ]
    with events_riding(events):  # one statement writes the slots and the events
        rows_insert(Slot, slots)
    return [
        Claim(job=job, executor=view.executor, slot_id=slot.pk, lease=lease)
        for (job, view), slot in zip(chosen, slots, strict=True)
    ]


def _tool_claim(job: Job) -> Claim:
    """A tool job holds no executor and no slot; tool_jobs_start gave it its lease."""
    assert job.lease is not None
    return Claim(job=job, executor=None, slot_id=None, lease=job.lease)


def _column(name: str) -> "Field[Any, Any]":
    """A column of Job (`get_field` also answers reverse relations, which have none)."""
    found = Job._meta.get_field(name)
    if not isinstance(found, Field):
        raise TypeError(f"Job.{name} is not a column")
    return found


def _mark_running(
    chosen: list[tuple[Job, ExecutorView]], *, worker: str, now: datetime, expires: datetime, lease: uuid.UUID
) -> dict[int, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """One statement for all the chosen rows: lock them (SKIP LOCKED on PostgreSQL; SQLite holds
    the whole database), check they are still queued, mark them running on their executor with
    their budget reservation (its first start kept: `started_at` is when the job first started,
    a flow's first round; each attempt's start is its slot's `acquired_at`), and read back their
    payload, left out of the heads the policy read. On PostgreSQL the same statement tells live
    views that jobs were claimed (once per transaction, however many rows), saving a round trip.
    Returns job id -> (input, conversation) for the rows it changed (lock level 3)."""
    qn = connection.ops.quote_name
    table, field = qn(Job._meta.db_table), _column
    postgres = connection.vendor == "postgresql"
    row = "(%s::bigint, %s::bigint, %s::jsonb)" if postgres else "(%s, %s, %s)"
    params: list[Any] = []
    for job, view in chosen:
        params += [job.pk, view.pk, field("reservation").get_db_prep_save(job.reservation, connection)]
    fixed = {"status": Job.Status.RUNNING.value, "worker": worker, "lease": lease, "lease_expires_at": expires}
    params += [field(name).get_db_prep_save(value, connection) for name, value in fixed.items()]
    params.append(field("started_at").get_db_prep_save(now, connection))
    queued = f"{qn('status')} = '{Job.Status.QUEUED.value}'"
    if postgres:
        lock = for_update_sql(level=Level.JOB, of="j", skip_locked=True)
        still_queued = (
            f"{table}.{qn('id')} IN (SELECT j.{qn('id')} FROM {table} j JOIN v ON j.{qn('id')} = v.job "
            f"WHERE j.{queued}{lock})"
        )
    else:
        still_queued = f"{table}.{queued}"
    sql = (
        f"WITH v(job, executor, reservation) AS (VALUES {', '.join([row] * len(chosen))}) "
        f"UPDATE {table} SET {qn('executor_id')} = v.executor, {qn('reservation')} = v.reservation, "
        + ", ".join(f"{qn(field(name).get_attname_column()[1] or name)} = %s" for name in fixed)
        + f", {qn('started_at')} = COALESCE({table}.{qn('started_at')}, %s)"
        + f", {qn('attempts')} = {table}.{qn('attempts')} + 1 "
        f"FROM v WHERE {table}.{qn('id')} = v.job AND {still_queued} "
        f"RETURNING {qn('id')}, {qn('input')}, {qn('conversation')}" + (", pg_notify(%s, %s)" if postgres else "")
    )
    if postgres:
        params += [notify.CHANGES_CHANNEL, "claimed"]
    payload, conversation = cast(JSONField, field("input")), cast(JSONField, field("conversation"))
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        # Django passes no expression here either when it converts a column read outside a query.
        return {
            pk: (
                payload.from_db_value(value, None, connection),  # type: ignore[arg-type]
                conversation.from_db_value(said, None, connection),  # type: ignore[arg-type]
            )
            for pk, value, said, *_ in cursor.fetchall()
        }
