import uuid
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from executors.health import breaker_trial_started
from executors.models import Executor
from quotas.budget import Account
from quotas.models import QuotaPolicy
from scheduler.core.configuration import configuration
from scheduler.core.locks import lock_claim
from scheduler.core.policy import policy_for
from scheduler.core.selectors import PAYLOAD_FIELDS
from scheduler.core.state import ClaimState, ExecutorView
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.events import events_record, events_riders, job_event
from scheduler.services.rounds import round_claimed, round_started_event
from scheduler.services.routes import routes_sweep
from scheduler.services.shares import team_shares_charge
from scheduler.services.tooljobs import tool_jobs_start
from scheduler.webhooks import jobs_failed_emit
from telemachus.control import notify
from telemachus.control.config import config_at
from telemachus.control.notify import changes_notify
from telemachus.db.bulk import rows_insert
from telemachus.db.changes import rows_save
from telemachus.db.locks import Level, rows_lock
from telemachus.db.notify import notice, notices_supported
from telemachus.db.pipeline import committing
from telemachus.db.statements import NO_RIDERS, Riders
from telemachus.errors import QuotaExceeded

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
        choice = _choose(record, state, limit=limit, only=only)
        for view in {view.pk: view for _, view, _ in choice.chosen if view.trial}.values():
            breaker_trial_started(executor=view.executor, now=now)
        claims = _start(choice.chosen, worker=worker, state=state) if choice.chosen else []
        told = bool(claims)  # live views were told by the statement that started them
        if record.tools_queued and only is None:
            expires = now + lease_length()
            claims += [
                _tool_claim(job)
                for job in tool_jobs_start(worker=worker, limit=limit - len(claims), now=now, expires=expires)
            ]
        if only is not None and len(claims) < len(only):
            notify.notify_workers(notify.QUEUED)
        if claims and not told:
            changes_notify("claimed")  # live dashboards, not workers
        _budget_refusals(state, deferred=choice.deferred, now=now)
        routes = configuration(config_at(record.config_version)).routes
        moved = routes_sweep(
            state,
            routes=routes if getattr(record, "routed_queued", True) else {},
            next_deadline=getattr(record, "next_deadline", None),
        )
        _settle(record, state, claims=claims, deferred=choice.deferred, now=now)
        wake_at = _next_eligible(state) if len(choice.chosen) < limit else None
        return ClaimBatch(
            claims=claims,
            # Jobs moved to another route model may start now: the caller claims again for them.
            backlog=choice.backlog or len(claims) >= limit or moved > 0,
            wake_in=0.0 if moved else max((wake_at - now).total_seconds(), 0.0) if wake_at is not None else None,
        )


@dataclass
class _Choice:
    """What the policy chose: each job with its executor and budget reservation, the jobs a budget
    deferred, and whether work may be waiting for capacity (`ClaimBatch.backlog`)."""

    chosen: list[tuple[Job, ExecutorView, dict[str, Any] | None]]
    deferred: dict[int, tuple[Job, Account]]
    backlog: bool


def _choose(record: QueuePolicy, state: ClaimState, *, limit: int, only: Collection[int] | None) -> _Choice:
    """Ask the policy for jobs in its order and place each that fits, under every cap and budget,
    until `limit` jobs are chosen or nothing more fits. A job passed over because a cap filled
    during this batch may hide others that now fit (a teammate behind a user who just reached
    their cap): the policy is asked again, with the caps as they stand, while each round still
    makes progress (at most MAX_ORDER_ROUNDS)."""
    chosen: list[tuple[Job, ExecutorView, dict[str, Any] | None]] = []
    deferred: dict[int, tuple[Job, Account]] = {}
    passed_over = False
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
                # An empty budget gets one event of its own (`_settle`); a job too big for what is
                # left of a budget gets one of its own.
                if account is not None and account.remaining > 0:
                    deferred[job.pk] = (job, account)
                continue
            if only is not None and job.pk not in only:
                head_elsewhere = passed_over = True
                break
            chosen.append((job, view, state.take(job, view)))
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
    return _Choice(chosen=chosen, deferred=deferred, backlog=backlog)


def _settle(
    record: QueuePolicy,
    state: ClaimState,
    *,
    claims: list[Claim],
    deferred: dict[int, tuple[Job, Account]],
    now: datetime,
) -> None:
    """The claim's last writes: deferrals, then ledger rows (lock level 4), the reservations of
    the jobs actually started and one `deferred` event for each budget found empty for the first
    time in its window; then fair share's entry penalty (lock level 5), with the COMMIT: a burst
    pays as it starts, before its usage is known, so it cannot take more than its share in the
    meantime."""
    _record_deferrals([(job, account) for job, account in deferred.values() if job.budget_wait], now=now)
    state.budgets.hold([claim.job.reservation for claim in claims])
    events_record(
        job_event(job=None, event=JobEvent.Type.DEFERRED, at=now, **account.describe())
        for account in state.budgets.note_exhausted()
    )
    charges: dict[int, float] = defaultdict(float)
    for claim in claims:
        charges[claim.job.team_id] += (
            claim.job.cost_estimate if record.cost == record.Cost.TOKENS else record.entry_penalty
        )
    with committing():  # the last write, whose rows nothing reads, goes with the COMMIT
        team_shares_charge(charges=charges, now=now, half_life=record.half_life_seconds)


def _next_eligible(state: ClaimState) -> datetime | None:
    """The next moment queued work that waits on time may become claimable: the earliest end of a
    retry's backoff (read with the claim lock), of a breaker's cooldown, or of a budget window
    that refused work or ran out, or of a wait the policy named (a round waiting for its preferred
    executor); or a queue deadline (read with the claim lock). A worker sleeps until then instead of polling."""
    moments = [
        *state.cooldown_ends,
        *state.wake_moments,
        state.budgets.next_reset(),
        getattr(state.policy, "next_retry", None),
        # A queue deadline to enforce (`routes_sweep`), unless it has passed and was just enforced.
        deadline if (deadline := getattr(state.policy, "next_deadline", None)) and deadline > state.now else None,
    ]
    return min(filter(None, moments), default=None)


# The most queued jobs one claim ends for a spent budget (the rest: the next claim's).
MAX_REFUSALS = 500


def _budget_refusals(state: ClaimState, *, deferred: dict[int, tuple[Job, Account]], now: datetime) -> None:
    """End, with the quota error, the queued jobs that do not wait for their budget
    (`Job.budget_wait` False: every /v1/ call) when their budget cannot cover them now: those the
    policy offered and a budget deferred, and those of teams, users and keys whose budget is spent
    (the heads of those are never read: scheduler/core/state.py `blocked_teams`), found through
    job_no_budget_wait_idx. Their callers answer 429 with the budget's reset_at at once instead of
    holding their connections until the window resets; the refusal is kept in the `failed` event.
    Only when some budget refuses something: otherwise no statement. Locks the rows (level 3)
    SKIP LOCKED, after the claim's own, so it never waits (a second batch of job rows, as the tool
    jobs' start takes)."""
    budgets = state.budgets
    teams = budgets.exhausted(QuotaPolicy.Scope.TEAM)
    users = budgets.exhausted(QuotaPolicy.Scope.USER) | budgets.exhausted(QuotaPolicy.Scope.KEY)
    offered = {job.pk: job for job, _ in deferred.values() if not job.budget_wait}
    everyone = budgets.global_exhausted()
    if not (everyone or teams or users or offered):
        return
    spent = Job.objects.filter(status=Job.Status.QUEUED, budget_wait=False)
    if not everyone:
        spent = spent.filter(Q(team_id__in=teams) | Q(user_id__in=users))
    found = list(
        rows_lock(spent.order_by("pk"), level=Level.JOB, skip_locked=True).defer(*PAYLOAD_FIELDS)[:MAX_REFUSALS]
    )
    refused: list[tuple[Job, QuotaExceeded]] = []
    for job in {**offered, **{job.pk: job for job in found}}.values():
        account = state.over_budget(job)
        if account is None:
            continue
        left = account.show(max(account.remaining, 0))
        refusal = QuotaExceeded(
            f"The {account.rule.dimension} budget of {account.rule.scope} {account.rule.subject or ''}".rstrip()
            + f" has {left} left per {account.rule.window}, spent while this job waited; it resets at "
            + f"{account.end.isoformat()}.",
            **account.describe(),
        )
        job.end(status=Job.Status.FAILED, at=now, error=refusal.detail)
        refused.append((job, refusal))
    if not refused:
        return
    read = rows_save(
        [job for job, _ in refused], where={"status": Job.Status.QUEUED}, lock=Level.JOB, returning=("id",)
    )
    ended = {pk for (pk,) in read()}
    events_record(
        job_event(job=job, event=JobEvent.Type.FAILED, at=now, refusal=refusal.body())
        for job, refusal in refused
        if job.pk in ended
    )
    jobs_failed_emit(jobs=[job for job, _ in refused if job.pk in ended])


def _record_deferrals(deferred: list[tuple[Job, Account]], *, now: datetime) -> None:
    """One `deferred` event per job per budget window: a job whose estimate the remaining budget
    cannot cover stays queued until the window resets, and says so once, not on every claim."""
    fresh = [(job, account) for job, account in deferred if job.deferred_until != account.end]
    if not fresh:
        return
    for job, account in fresh:
        job.defer(until=account.end)
    rows_save([job for job, _ in fresh], where={"status": Job.Status.QUEUED})
    events_record(
        job_event(job=job, event=JobEvent.Type.DEFERRED, at=now, estimate=job.cost_estimate, **account.describe())
        for job, account in fresh
    )


def _start(
    chosen: list[tuple[Job, ExecutorView, dict[str, Any] | None]], *, worker: str, state: ClaimState
) -> list[Claim]:
    """Start the chosen jobs under one lease token for this claim (the fencing token is the pair
    job id + lease): `Job.start`, written by one statement that locks their rows (SKIP LOCKED on
    PostgreSQL, level 3; SQLite holds the whole database), writes only those still queued as the
    claim read them, tells live views that jobs were claimed, and reads back their payload, left
    out of the heads the policy read. A job that is no longer queued, or that another transaction
    holds (a cancel at this very moment), is left out, not waited for. Then their slots and events,
    in one statement."""
    now, expires, lease = state.now, state.now + lease_length(), uuid.uuid4()
    jobs = [job for job, _, _ in chosen]
    read = [{"attempts": job.attempts} for job in jobs]
    for job, view, reservation in chosen:
        job.start(executor=view.executor, worker=worker, lease=lease, expires=expires, now=now, reservation=reservation)
    started = rows_save(
        jobs,
        where={"status": Job.Status.QUEUED},
        expect=read,
        lock=Level.JOB,
        returning=("id", "input", "conversation"),
        riders=Riders(notices=[notice(notify.CHANGES_CHANNEL, ["claimed"])]) if notices_supported() else NO_RIDERS,
    )()
    payloads = {pk: (payload, conversation) for pk, payload, conversation in started}
    chosen = [(job, view, reservation) for job, view, reservation in chosen if job.pk in payloads]
    if not chosen:
        return []
    events, slots = [], []
    for job, view, _ in chosen:
        job.input, job.conversation = payloads[job.pk]
        events.append(job_event(job=job, event=JobEvent.Type.PLACED, at=now, executor=view.pk, attempt=job.attempts))
        events.append(job_event(job=job, event=JobEvent.Type.STARTED, at=now, executor=view.pk, worker=worker))
        if round_claimed(job) is not None:
            # A flow's round starts with its claim: its holder makes no write before the model call.
            events.append(round_started_event(job, at=now))
        slots.append(
            Slot(
                job=job,
                executor=view.executor,
                team_id=job.team_id,
                user_id=job.user_id,
                worker=worker,
                acquired_at=now,
                batch=job.batch_id is not None,
            )
        )
    rows_insert(Slot, slots, riders=events_riders(events))  # one statement writes the slots and the events
    return [
        Claim(job=job, executor=view.executor, slot_id=slot.pk, lease=lease)
        for (job, view, _), slot in zip(chosen, slots, strict=True)
    ]


def _tool_claim(job: Job) -> Claim:
    """A tool job holds no executor and no slot; tool_jobs_start gave it its lease."""
    assert job.lease is not None
    return Claim(job=job, executor=None, slot_id=None, lease=job.lease)
