"""Model routes at work (issue #39): which of a route's models a job runs on, and when it moves on.

A route (executors.models.ModelRoute) is a public name for an ordered list of models. A job on a
route stands on one of them (`Job.model`, the column the claim filters on) and moves to a later
one (`Job.fall_back`, with a `fell_back` event saying why) when:

* at submit, a model has no executor the team may use (`not_offered`), none of its executors can
  take work now (all down, disabled or their breakers open: `no_executor`), or the prompt, counted
  with the estimate the budgets use, is longer than every one of its executors' `context_window`
  (`context_window`): `route_choose`;
* while it waits, its model's executors all stop taking work (`no_executor`), or its queue
  deadline passes and a later model has a free slot now (`queue_deadline`): `routes_sweep`, run by
  every claim, which ends a job whose deadline passed and that no model can start now with 429
  `queue_deadline_exceeded`;
* it failed on its model after its retries with a retryable error (`failed`): the finish
  (scheduler/services/finish.py) calls `Job.fall_back` instead of ending it.

Budgets and prices follow the model that ran: an attempt is priced with the prices of the executor
that ran it, for the model it ran (scheduler/services/attempts.py)."""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Q

from executors.contract import EMBEDDINGS_API
from executors.models import Executor
from scheduler.core.configuration import Configuration
from scheduler.core.jobtypes import MODEL_CALL_TYPES, TASK_TYPES
from scheduler.core.selectors import PAYLOAD_FIELDS
from scheduler.core.state import ClaimState
from scheduler.models import Job, JobEvent
from scheduler.services.events import events_record, job_event
from scheduler.webhooks import jobs_failed_emit
from telemachus.control import notify
from telemachus.db.changes import rows_save
from telemachus.db.locks import Level, rows_lock
from telemachus.errors import QueueDeadlineExceeded, UnknownModel, ValidationFailed

# Why a job moved to its route's next model (the `fell_back` event's `reason`).
NOT_OFFERED, NO_EXECUTOR, CONTEXT_WINDOW, FAILED, QUEUE_DEADLINE = (
    "not_offered",
    "no_executor",
    "context_window",
    "failed",
    "queue_deadline",
)

# The most queued jobs one claim moves or ends (the rest: the next claim's).
MAX_SWEPT = 500


@dataclass
class RouteChoice:
    """The model a routed job starts on, the executors that could take it, and the models it
    passed over, each with why."""

    model: str
    usable: list[Executor]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def executor_takes_work(executor: Executor, now: datetime) -> bool:
    """Whether the claim would place work on the executor now, full or not: enabled, not down,
    its breaker not open in its cooldown (one past its cooldown takes a trial)."""
    cooling = (
        executor.breaker == Executor.Breaker.OPEN
        and executor.breaker_until is not None
        and executor.breaker_until > now
    )
    return executor.enabled and executor.health != Executor.Health.DOWN and not cooling


def fits_window(executor: Executor, prompt_tokens: int) -> bool:
    """The prompt fits the executor's `context_window` capability (none declared: it fits)."""
    window = executor.capabilities.get("context_window")
    return not isinstance(window, int) or isinstance(window, bool) or prompt_tokens <= window


def route_choose(
    conf: Configuration,
    *,
    team_id: int,
    team_slug: str,
    type: str,
    route: str,
    requirements: dict[str, Any],
    prompt_tokens: int,
    now: datetime,
) -> RouteChoice:
    """The first model of the route that an executor usable by the team offers, takes work now,
    and whose context window holds the prompt. When none takes work now, the first whose window
    holds the prompt (the job waits for its executors; a claim moves it on when another model's
    come back first). Refuses a route no model of which the team may use (400 unknown_model) and a
    prompt no model's window holds (400, on `input`). No query: the configuration cache."""
    embeddings = requirements.get("api") == EMBEDDINGS_API
    chat, tasks = type in MODEL_CALL_TYPES, type in TASK_TYPES
    skipped: list[tuple[str, str]] = []
    waiting: RouteChoice | None = None
    windows: list[int] = []
    for model in conf.routes[route]:
        usable = conf.executors_usable_by(team_id=team_id, model=model, embeddings=embeddings, chat=chat, tasks=tasks)
        if not usable:
            skipped.append((model, NOT_OFFERED))
            continue
        fitting = [e for e in usable if fits_window(e, prompt_tokens)]
        if not fitting:
            windows += [e.capabilities["context_window"] for e in usable]
            skipped.append((model, CONTEXT_WINDOW))
            continue
        if not any(executor_takes_work(e, now) for e in fitting):
            waiting = waiting or RouteChoice(model=model, usable=fitting, skipped=list(skipped))
            skipped.append((model, NO_EXECUTOR))
            continue
        return RouteChoice(model=model, usable=fitting, skipped=skipped)
    if waiting is not None:
        return waiting
    if windows:
        raise ValidationFailed(
            {
                "input": [
                    f"The prompt (about {prompt_tokens} tokens) fits no model of route {route!r}: the largest "
                    f"context window is {max(windows)} tokens."
                ]
            },
            detail="The prompt is longer than the context window of every model of the route.",
        )
    raise UnknownModel(
        f"No enabled executor available to team {team_slug!r} offers a model of route {route!r}.", model=route
    )


def fell_back_events(job: Job, skipped: Iterable[tuple[str, str]], *, at: datetime) -> list[JobEvent]:
    """A submitted routed job's `fell_back` events: one per model it passed over, to the next."""
    events, passed = [], list(skipped)
    for i, (model, reason) in enumerate(passed):
        to = passed[i + 1][0] if i + 1 < len(passed) else job.model
        details = {"from": model, "to": to, "reason": reason}
        events.append(job_event(job=job, event=JobEvent.Type.FELL_BACK, at=at, executor=None, **details))
    return events


def routes_sweep(state: ClaimState, *, routes: dict[str, tuple[str, ...]], next_deadline: datetime | None) -> int:
    """The claim's moves of waiting routed jobs, after it chose and started what it could (so the
    slots it took are counted, and the job rows come after its own in the lock order): each job
    whose queue deadline passed moves to a later model of its route with a free slot for it now,
    or ends failed with the 429 `queue_deadline_exceeded` refusal; each routed job whose model no
    executor takes work for any more (all down, disabled or breaker open) moves to the first later
    model whose executors do. Queries only when a deadline has passed (`next_deadline`, read with
    the claim lock) or a route's model has no placeable executor. Locks job rows (level 3) SKIP
    LOCKED. `routes`: the model routes, or none when no routed job is queued (read with the claim
    lock). Returns how many jobs moved to another model (the caller claims again for them)."""
    now = state.now
    due = next_deadline is not None and next_deadline <= now
    offered = {m for view in state.executors for m in view.executor.capabilities.get("models") or ()}
    dead = {m for models in routes.values() for m in models} - offered
    if not due and not dead:
        return 0
    wanted = Q()
    if due:
        wanted |= Q(queue_deadline__lte=now)
    if dead:
        wanted |= Q(model__in=sorted(dead)) & ~Q(route="")
    found = list(
        rows_lock(
            Job.objects.filter(wanted, status=Job.Status.QUEUED).order_by("pk"), level=Level.JOB, skip_locked=True
        ).defer(*PAYLOAD_FIELDS)[:MAX_SWEPT]
    )
    moved: list[tuple[Job, str, str]] = []
    ended: list[tuple[Job, QueueDeadlineExceeded]] = []
    for job in found:
        before = job.model
        if job.queue_deadline is not None and job.queue_deadline <= now:
            if _takes_now(job, state):
                continue  # a slot for it is free now (the claim took others first): the next claim's
            target = _later_model(job, state, free_now=True)
            if target is not None:
                job.fall_back(model=target, now=now)
                moved.append((job, before, QUEUE_DEADLINE))
                continue
            ended.append((job, _deadline_refusal(job, now)))
        elif job.model in dead and (target := _later_model(job, state, free_now=False)) is not None:
            job.fall_back(model=target, now=now)
            moved.append((job, before, NO_EXECUTOR))
    for job, refusal in ended:
        job.end(status=Job.Status.FAILED, at=now, error=refusal.detail)
    if not moved and not ended:
        return 0
    saved, closed = _saved([job for job, _, _ in moved]), _saved([job for job, _ in ended])
    events_record(
        [
            *(
                job_event(
                    job=job, event=JobEvent.Type.FELL_BACK, at=now, executor=None, **_moved(before, job.model, why)
                )
                for job, before, why in moved
                if job.pk in saved
            ),
            *(
                job_event(job=job, event=JobEvent.Type.FAILED, at=now, refusal=refusal.body())
                for job, refusal in ended
                if job.pk in closed
            ),
        ]
    )
    jobs_failed_emit(jobs=[job for job, _ in ended if job.pk in closed])
    if saved:
        notify.notify_workers(notify.QUEUED)  # at commit: any worker may start them on their new model
    return len(saved)


def _moved(before: str, after: str, why: str) -> dict[str, str]:
    return {"from": before, "to": after, "reason": why}


def _saved(jobs: list[Job]) -> set[int]:
    """Write what the jobs' moves changed, to those still queued; their ids."""
    if not jobs:
        return set()
    read = rows_save(jobs, where={"status": Job.Status.QUEUED}, lock=Level.JOB, returning=("id",))
    return {pk for (pk,) in read()}


def _takes_now(job: Job, state: ClaimState) -> bool:
    """Some executor of the job's model has a free slot for it now, under every cap."""
    return state.fits(job) and any(v.free > 0 and v.usable_by(job.team_id) and v.matches(job) for v in state.executors)


def _later_model(job: Job, state: ClaimState, *, free_now: bool) -> str | None:
    """The first model after the job's on its route that some placeable executor takes it on
    (with `free_now`: with a free slot under every cap now, its window holding the prompt)."""
    models: list[str] = job.route_models or []
    if job.model not in models:
        return None
    current = job.model
    try:
        for model in models[models.index(current) + 1 :]:
            job.model = model  # what ExecutorView.matches reads
            views = [
                v
                for v in state.executors
                if v.usable_by(job.team_id) and v.matches(job) and fits_window(v.executor, job.est_prompt_tokens)
            ]
            if views and (not free_now or (state.fits(job) and any(v.free > 0 for v in views))):
                return model
        return None
    finally:
        job.model = current


def _deadline_refusal(job: Job, now: datetime) -> QueueDeadlineExceeded:
    """The 429 a job past its queue deadline ends with; Retry-After: the wait it allowed itself."""
    allowed = float(job.requirements.get("max_queue_seconds") or 0)
    waited = (now - job.submitted_at).total_seconds()
    return QueueDeadlineExceeded(
        f"No slot was free for model {job.model!r} within the job's queue deadline of {allowed:g} s "
        f"(it waited {waited:.1f} s)" + (f"; route {job.route!r} has no later model free now." if job.route else "."),
        retry_after=max(1, math.ceil(allowed)),
    )
