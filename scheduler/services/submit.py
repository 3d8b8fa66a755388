"""Admission: from a request to a queued job (or a refusal), at the speed of the API.

The checks read only configuration (teams, memberships, permissions, executors, quota rules, the
queue policy), kept per configuration version (scheduler/core/configuration.py), and confirmed by
the statement that writes the jobs: an unchanged configuration costs no round trip; if it moved
since the process last read it, the submit reads it again and checks again. What must be live is
read live: the budget ledger (one query, only when a budget applies: the submit never writes it,
so it needs no lock) and the queue depth, which the statement reads from the queue tally under
the team's lock and checks against the policy's cap (`queue_room`) before it inserts.

One path on both databases: the checks in Python, then one statement built in one place
(scheduler/core/statements.py). On PostgreSQL it is the whole write, and commits by itself: lock
the teams' rows and tally rows, confirm the version, insert the jobs and their events only if the
queues have room, wake the workers. On SQLite the same guard runs in a write transaction, then
the inserts. A refusal comes back from that statement, which says why (a moved configuration, a
full queue). Round trips per submit (tests/scheduler/services/test_submit.py pins them): one on
PostgreSQL, two with a budget (the ledger's read)."""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from executors.contract import EMBEDDINGS_API
from executors.models import Executor
from quotas.budget import Budgets, admission_budgets, quota_check
from quotas.models import ZERO
from scheduler.core.configuration import Configuration, configuration, grants, policy_record
from scheduler.core.estimates import job_estimate
from scheduler.core.jobtypes import MODEL_CALL_TYPES, TASK_TYPES, job_feature, job_input_check
from scheduler.core.money import job_money_estimate, token_split_estimate
from scheduler.core.policy import Admission, AdmissionState, BaseQueuePolicy, policy_for
from scheduler.core.prefix import prompt_prefix
from scheduler.core.statements import guard_checked, submit_admitted, submit_guard, submit_statement
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.rbac import JOB_TYPE_PERMISSION
from scheduler.services.events import events_record, job_event, submitted_events
from scheduler.services.retention import holds_for
from scheduler.services.routes import executor_takes_work, fell_back_events, route_choose
from telemachus import tracing
from telemachus.control.config import ConfigSnapshot, StaleConfiguration, config_believed
from telemachus.control.features import feature_require
from telemachus.db.bulk import rows_insert
from telemachus.db.rows import rows_stored
from telemachus.db.statements import riding_supported
from telemachus.errors import DomainError, TryLater, UnknownModel, ValidationFailed
from telemachus.models import ApiKey, Team
from telemachus.teams import rbac

# What a job does when its budget is spent while it waits (`requirements.on_budget_exhausted`).
BUDGET_WAIT, BUDGET_FAIL = "wait", "fail"

# The most jobs one bulk submit may carry.
MAX_BULK = 1000

# The longest queue deadline a job may name (requirements.max_queue_seconds), in seconds: a day.
MAX_QUEUE_SECONDS = 86_400


@dataclass(frozen=True)
class JobSpec:
    """One job to submit, shape-checked (JobSubmitInput). `team` None: the submitter's only team,
    chosen from the same configuration the submit's statement confirms (TeamRequired when it is in
    none or several), so a membership just added or removed is never missed."""

    team: str | None
    type: str
    requirements: dict[str, Any]
    input: dict[str, Any]
    priority: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    run_after: datetime | None = None
    # Switches the entry point needs on besides the job's kind (the /v1/ endpoints: `openai`),
    # checked first with the same cached switches, so a switch turned off is refused at once.
    features: tuple[str, ...] = ()
    # A session the job continues (the /v1/ header X-Telemachus-Session): it prefers the executor
    # that served the session's last call in its team (QueuePolicy.affinity).
    affinity_key: str = ""
    # Seconds its submitter waits for the answer (a /v1/ call): if the team removes bodies early
    # (body_retention_hours), its body is kept that long (Job.body_hold_until).
    body_hold_seconds: float = 0.0
    # A batch's line (scheduler/batches/feeder.py): its batch and line number, and the trace
    # context of the line's own span, which the job keeps instead of the submit's (while tracing).
    batch_id: str | None = None
    batch_line: int | None = None
    trace: dict[str, str] | None = None


def job_submit(
    *,
    user: rbac.Principal,
    team: str | None,
    type: str,
    requirements: dict[str, Any],
    input: dict[str, Any],
    priority: int = 0,
    meta: dict[str, Any] | None = None,
    run_after: datetime | None = None,
    features: tuple[str, ...] = (),
    key: ApiKey | None = None,
    wake: bool = True,
    affinity_key: str = "",
    body_hold_seconds: float = 0.0,
) -> Job:
    """Admit a job and persist it `queued` with its `queued` event, in one transaction.

    `requirements` and `input` arrive shape-checked (JobSubmitInput); this checks, in order: the
    team (which the user must belong to), that the job's kind is switched on for it (403
    feature_disabled), the permission the job type needs (RBAC.require), the tools it names
    (scheduler/core/jobtypes.py), an enabled executor usable by the team that offers the model (and
    embeddings, when `requirements.api` asks for them; a tool job needs none), the budgets
    (Quota.check) for the
    estimate, the priority the principal may use (priority map: clamped, with an event, or
    refused, per policy) and the policy's admission (the team's queue depth cap: 429 try_later).
    Nothing is written when a check fails. Locks the team's row while it reads its queue depth, so
    concurrent submits cannot overfill it. Wakes the workers on commit. With `run_after` (an aware
    datetime) the job waits in the queue, counted against the depth cap, and no claim takes it
    before then (the same not-before time a retry waits on).

    `key`: the app key the caller authenticated with (`user` is then the key's own user). The job
    records it, and a model the key may not call is refused like one no executor offers (400
    unknown_model naming it; 404 model_not_found on /v1/).

    `wake` False: the workers are not woken, because the caller claims the job itself at once
    (scheduler/gateway/onehop.py), and that claim wakes them if it leaves the job queued.

    `affinity_key`: the session the job continues; it prefers the executor that served the last
    call of that session in its team (one more query, only with a key).

    `body_hold_seconds`: how long the caller waits for the answer (a /v1/ call): if the team
    removes bodies early, its prompt and answer are kept at least that long from now, or until
    the caller lets go (scheduler/services/retention.py `body_hold_release`)."""
    spec = JobSpec(
        team=team,
        type=type,
        requirements=requirements,
        input=input,
        priority=priority,
        meta=meta or {},
        run_after=run_after,
        features=features,
        affinity_key=affinity_key,
        body_hold_seconds=body_hold_seconds,
    )
    if tracing.active:
        (job,) = _submit_traced(user=user, specs=[spec], key=key, wake=wake)
    else:
        (job,) = _submit(user=user, specs=[spec], key=key, wake=wake)
    return job


def jobs_submit(*, user: rbac.Principal, jobs: Sequence[JobSpec], key: ApiKey | None = None) -> list[Job]:
    """Submit up to MAX_BULK jobs at once, all or nothing: each is checked as `job_submit` checks
    it, and the queue depth cap counts the whole batch (a team's queued jobs plus those of the
    batch before each one). One transaction; team rows locked in ascending id. A refusal names
    the failing job's position in `index` and nothing is written."""
    if not 1 <= len(jobs) <= MAX_BULK:
        raise ValidationFailed({"jobs": [f"Between 1 and {MAX_BULK} jobs."]})
    if tracing.active:
        return _submit_traced(user=user, specs=jobs, indexed=True, key=key)
    return _submit(user=user, specs=jobs, indexed=True, key=key)


@dataclass
class _Admitted:
    """A job that passed the configuration checks, before the live ones."""

    job: Job
    requested: int
    allowed: int
    source: str
    # The executors that could take it (for its money estimate against `ai.cost` budgets).
    executors: list[Executor] = field(default_factory=list)
    # A routed job's models passed over at submit, each with why (its `fell_back` events).
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _submit(
    *,
    user: rbac.Principal,
    specs: Sequence[JobSpec],
    indexed: bool = False,
    key: ApiKey | None = None,
    wake: bool = True,
) -> list[Job]:
    """Check against the configuration this process last read; the statement that writes the
    jobs confirms its version. A refusal from configuration that may be stale is checked again on
    a fresh read before it is believed (`config_believed`)."""
    return config_believed(
        lambda snapshot: _admit(user=user, specs=specs, snapshot=snapshot, indexed=indexed, key=key, wake=wake)
    )


def _submit_traced(
    *,
    user: rbac.Principal,
    specs: Sequence[JobSpec],
    indexed: bool = False,
    key: ApiKey | None = None,
    wake: bool = True,
) -> list[Job]:
    """The submit inside its `job.submit` span, a child of the current span (the request's, or the
    calling code's), each job keeping the span's context in `meta.trace` (or its spec's own, a
    batch line's): the spans of its work, in whatever process claims it, join the same trace
    (scheduler/worker/traces.py). A refusal fails the span with the error it raises."""
    with tracing.span("job.submit", attributes={"telemachus.jobs": len(specs)}) as span:
        carrier = tracing.trace_carrier()
        jobs = _submit(
            user=user,
            specs=[replace(spec, meta={**spec.meta, tracing.TRACE_META_KEY: spec.trace or carrier}) for spec in specs],
            indexed=indexed,
            key=key,
            wake=wake,
        )
        if len(jobs) == 1:
            (job,) = jobs
            span.set_attributes(
                {
                    "telemachus.job.id": job.pk,
                    "telemachus.job.type": job.type,
                    "telemachus.team": job.team.slug,
                    "telemachus.job.priority": job.priority,
                    "gen_ai.request.model": job.model,
                }
            )
        else:
            span.set_attribute("telemachus.job.ids", [job.pk for job in jobs])
        return jobs


def _admit(
    *,
    user: rbac.Principal,
    specs: Sequence[JobSpec],
    snapshot: ConfigSnapshot,
    indexed: bool,
    key: ApiKey | None,
    wake: bool = True,
) -> list[Job]:
    conf, record, who = configuration(snapshot), policy_record(snapshot), grants(snapshot, user)
    now = timezone.now()
    admitted = [
        _check(conf, record, who, user, spec, now, index=i if indexed else None, key=key)
        for i, spec in enumerate(specs)
    ]
    subjects = {(item.job.team_id, item.job.user_id) for item in admitted}
    budgets = admission_budgets(subjects=subjects, now=now, rules=conf.admission_rules(subjects))
    if budgets.accounts:
        budgets.read()
        _within_budgets(budgets, admitted, now, indexed=indexed)
    policy = policy_for(record)
    _policy_admits(policy, admitted, now, indexed=indexed)
    _sessions_continue([item.job for item in admitted])
    _prefixes_continue([item.job for item in admitted], conf=conf, now=now)
    return _write(admitted, policy=policy, version=snapshot.version, now=now, indexed=indexed, wake=wake)


def _policy_admits(policy: BaseQueuePolicy, admitted: list[_Admitted], now: datetime, *, indexed: bool) -> None:
    """The policy's own admission rules (`admit`: none by default; the depth cap is the
    statement's, from `queue_room`), each job with its team's jobs of this submission ahead of it."""
    states: dict[int, AdmissionState] = {}
    ahead: Counter[int] = Counter()
    for i, item in enumerate(admitted):
        team = item.job.team
        state = states.setdefault(team.pk, AdmissionState(team=team, now=now))
        state.pending = ahead[team.pk]
        admission = policy.admit(item.job, state)
        if admission.decision == Admission.REJECT:
            raise _at(TryLater(admission.reason, retry_after=admission.retry_after or 60), i if indexed else None)
        ahead[team.pk] += 1


def _write(
    admitted: list[_Admitted], *, policy: BaseQueuePolicy, version: int, now: datetime, indexed: bool, wake: bool
) -> list[Job]:
    """The jobs and their events written by the submit's statement (scheduler/core/statements.py),
    only if the configuration is still `version` and each team's queue has room for its jobs;
    otherwise nothing is written, and the refusal says why."""
    jobs = [item.job for item in admitted]
    batch = Counter(job.team_id for job in jobs)
    teams = {job.team_id: job.team for job in jobs}
    limits = {team_id: policy.queue_room(team) for team_id, team in teams.items()}
    rooms = [(team_id, limits[team_id] - batch[team_id]) for team_id in sorted(teams)]
    events = [
        (position, event) for position, item in enumerate(admitted, start=1) for event in _submit_events(item, now)
    ]
    guard = submit_guard(rooms=rooms, version=version, pending=not connection.get_autocommit())
    if riding_supported():
        statement = submit_statement(guard=guard, jobs=jobs, events=submitted_events(events), wake=wake)
        found = submit_admitted(statement.rows(prepared=True)[0])
        if found.ok:
            rows_stored(jobs, found.ids)
    else:
        with transaction.atomic():
            found = guard_checked(guard)
            if found.ok:
                rows_insert(Job, jobs)
                for at, event in events:
                    event.job = jobs[at - 1]  # now that it has its id
                events_record(event for _, event in events)
    if found.ok:
        return jobs
    if found.version != version:
        raise StaleConfiguration(found.version)
    missing = sorted(set(teams) - set(found.depths))
    if missing:
        raise RuntimeError(f"the queue tally has no rows for team(s) {missing}: are the migrations applied?")
    team_id = next(t for t, room in rooms if found.depths[t] > room)
    refusal = policy.queue_full(
        AdmissionState(team=teams[team_id], now=now), depth=found.depths[team_id], limit=limits[team_id]
    )
    first = max(limits[team_id] - found.depths[team_id], 0)  # this team's first job past the cap
    index = [i for i, job in enumerate(jobs) if job.team_id == team_id][first]
    raise _at(TryLater(refusal.reason, retry_after=refusal.retry_after or 60), index if indexed else None)


def _check(
    conf: Configuration,
    record: QueuePolicy,
    who: rbac.Grants,
    user: rbac.Principal,
    spec: JobSpec,
    now: datetime,
    *,
    index: int | None,
    key: ApiKey | None = None,
) -> _Admitted:
    """The configuration checks of one job, in job_submit's order; the job, unsaved."""
    try:
        team = who.team_for_submit(conf.team(spec.team), spec.team) if spec.team else who.only_team(conf.teams)
        for feature in (*spec.features, job_feature(spec.type)):
            feature_require(feature=feature, team=team, switches=conf.features)
        who.require(JOB_TYPE_PERMISSION[spec.type], team=team)
        job_input_check(
            type=spec.type, input=spec.input, team=team, require=lambda permission: who.require(permission, team=team)
        )
        # A tool job runs in a worker's tool threads, on no executor: it names no model.
        model = "" if spec.type == Job.Type.TOOL else spec.requirements["model"]
        # A key's model list may name models and routes: what it checks is the name called.
        if key is not None and model and key.allowed_models and model not in key.allowed_models:
            raise UnknownModel(
                f"This API key may not call model {model!r}; it may call {', '.join(map(repr, key.allowed_models))}.",
                model=model,
            )
        route = model if model in conf.routes else ""
        # The submitter's est_tokens, else a real estimate (scheduler/core/estimates.py), never 0;
        # a route's, with its first model.
        estimate = job_estimate(
            type=spec.type,
            model=conf.routes[route][0] if route else model,
            requirements=spec.requirements,
            input=spec.input,
        )
        prompt, completion = token_split_estimate(
            type=spec.type, requirements=spec.requirements, input=spec.input, estimate=estimate
        )
        skipped: list[tuple[str, str]] = []
        if route:
            choice = route_choose(
                conf,
                team_id=team.pk,
                team_slug=team.slug,
                type=spec.type,
                route=route,
                requirements=spec.requirements,
                prompt_tokens=prompt,
                now=now,
            )
            model, usable, skipped = choice.model, choice.usable, choice.skipped
        else:
            usable = (
                _placeable(conf, team=team, type=spec.type, model=model, requirements=spec.requirements)
                if model
                else []
            )
        allowed, source = priority_ceiling(record, who=who, team=team)
        if spec.priority > allowed and record.priority_over_limit == QueuePolicy.OverLimit.REJECT:
            raise ValidationFailed({"priority": [f"At most {allowed} for you in team {team.slug!r} ({source})."]})
    except DomainError as exc:
        raise _at(exc, index) from None
    # A job deferred to `run_after` enters the line, and starts ageing, when it may run.
    ready = max(now, spec.run_after) if spec.run_after else now
    wait = spec.requirements.get("max_queue_seconds")
    job = Job(
        type=spec.type,
        user=rbac.signed_in(user),
        team=team,
        priority=min(spec.priority, allowed),
        requirements=spec.requirements,
        model=model,
        cost_estimate=estimate,
        est_prompt_tokens=prompt,
        est_completion_tokens=completion,
        key=key,
        input=spec.input,
        meta=spec.meta,
        submitted_at=now,
        run_after=spec.run_after,
        ready_at=ready,
        queued_at=ready,
        affinity_key=spec.affinity_key,
        body_hold_until=now + timedelta(seconds=spec.body_hold_seconds)
        if spec.body_hold_seconds and holds_for(team)
        else None,
        batch_id=spec.batch_id,
        batch_line=spec.batch_line,
        budget_wait=spec.requirements.get("on_budget_exhausted", BUDGET_WAIT) == BUDGET_WAIT,
        route=route,
        route_models=list(conf.routes[route]) if route else None,
        queue_deadline=ready + timedelta(seconds=wait) if wait is not None else None,
    )
    if record.placement == QueuePolicy.Placement.PREFIX and (prefix := prompt_prefix(spec.input)):
        job.prefix, job.prefix_key = prefix, prefix[0]
    return _Admitted(
        job=job, requested=spec.priority, allowed=allowed, source=source, executors=usable, skipped=skipped
    )


def _sessions_continue(jobs: list[Job]) -> None:
    """Each job that continues a session prefers the executor that served the session's last
    placed call in its team (job_affinity_idx): the model server that may still hold the prefix
    cache of the conversation. One query per session submitted."""
    sessions = {(job.team_id, job.affinity_key) for job in jobs if job.affinity_key}
    preferred = {
        (team_id, key): Job.objects.filter(team_id=team_id, affinity_key=key, executor__isnull=False)
        .order_by("-id")
        .values_list("executor_id", flat=True)
        .first()
        for team_id, key in sessions
    }
    for job in jobs:
        if job.affinity_key:
            job.affinity_executor_id = preferred[(job.team_id, job.affinity_key)]


def _prefixes_continue(jobs: list[Job], *, conf: Configuration, now: datetime) -> None:
    """Under prefix placement (scheduler/core/prefix.py), each job whose prompt starts with a
    block seen before learns the prefix's home from the last placed job with that first block
    (job_prefix_idx): the home that job was given, while that executor still takes work, else
    where it ran (a job that spilled past the load bound does not move the home; one whose home
    stopped does). The record of where a prefix lives that every process shares. One query per
    first block submitted."""
    keys = {job.prefix_key for job in jobs if job.prefix_key}
    if not keys:  # every submit passes here; only prefix placement sets keys
        return
    working = {e.pk for e in conf.executors if executor_takes_work(e, now)}
    homes: dict[str, int | None] = {}
    for key in keys:
        last = (
            Job.objects.filter(prefix_key=key, executor__isnull=False)
            .order_by("-id")
            .values_list("prefix_home", "executor_id")
            .first()
        )
        homes[key] = None if last is None else last[0] if last[0] in working else last[1]
    for job in jobs:
        if job.prefix_key:
            job.prefix_home = homes[job.prefix_key]


def _placeable(
    conf: Configuration, *, team: Team, type: str, model: str, requirements: dict[str, Any]
) -> list[Executor]:
    """The enabled executors the team may use that offer the model and are of a kind that runs
    jobs of this type: model calls (chat, translate, flow) on model executors, tasks on executors
    that run tasks. Refuses a model nothing offers (400 unknown_model), and a model offered only
    by executors of the wrong kind (400 naming the type and the model): a task job naming a chat
    model would otherwise run as a chat completion."""
    embeddings = requirements.get("api") == EMBEDDINGS_API
    chat, tasks = type in MODEL_CALL_TYPES, type in TASK_TYPES
    usable = conf.executors_usable_by(team_id=team.pk, model=model, embeddings=embeddings, chat=chat, tasks=tasks)
    if usable:
        return usable
    offering = conf.executors_usable_by(team_id=team.pk, model=model, embeddings=embeddings)
    if offering and tasks:
        kinds = ", ".join(sorted({e.kind for e in offering}))
        raise ValidationFailed(
            {
                "type": [
                    f"{type!r} jobs cannot use model {model!r}: the executors available to team {team.slug!r} "
                    f"that offer it (kind {kinds}) do not run tasks."
                ]
            },
            detail=f"No executor runs {type} jobs for model {model!r}.",
        )
    # A model call naming what only a cpu-node offers (a task queue): not a model, as far as model
    # calls go (the OpenAI-compatible endpoint answers 404 model_not_found).
    offers = f"embeddings of model {model!r}" if embeddings else f"model {model!r}"
    offers += f" for {type} jobs" if offering else ""
    raise UnknownModel(f"No enabled executor available to team {team.slug!r} offers {offers}.", model=model, type=type)


def _within_budgets(budgets: Budgets, admitted: list[_Admitted], now: datetime, *, indexed: bool) -> None:
    """Quota.check for each job, against the ledger as read with the team lock."""
    if not budgets.accounts:
        return
    for i, item in enumerate(admitted):
        try:
            quota_check(
                team_id=item.job.team_id,
                user_id=item.job.user_id,
                tokens=item.job.cost_estimate,
                now=now,
                budgets=budgets,
                money=job_money_estimate(item.job, item.executors) if budgets.has_money else ZERO,
            )
        except DomainError as exc:
            raise _at(exc, i if indexed else None) from None


def _submit_events(item: _Admitted, now: datetime) -> list[JobEvent]:
    """A submitted job's events (unsaved): `queued` (with its not-before time, if deferred), and
    `priority_clamped` when the priority map lowered what it asked for."""
    job = item.job
    queued: dict[str, Any] = {"priority": job.priority}
    if job.run_after is not None:
        queued["run_after"] = job.run_after.isoformat()
    if job.route:
        queued["route"] = job.route
    events = [
        # No `job`: the statement sets it from the new id (`_write`); an unsaved job through the
        # foreign key's descriptor was a twentieth of a one-by-one submit's Python time.
        job_event(job=None, event=JobEvent.Type.QUEUED, at=now, **queued),
        *fell_back_events(job, item.skipped, at=now),
    ]
    if item.requested > item.allowed:
        clamped: dict[str, Any] = {"requested": item.requested, "allowed": item.allowed, "reason": item.source}
        events.append(job_event(job=job, event=JobEvent.Type.PRIORITY_CLAMPED, at=now, **clamped))
    return events


def _at(exc: DomainError, index: int | None) -> DomainError:
    """The error, naming the failing job's position in a bulk submit."""
    if index is not None:
        exc.extra["index"] = index
    return exc


def priority_ceiling(record: QueuePolicy, *, who: rbac.Grants, team: Team) -> tuple[int, str]:
    """The highest priority this principal may use in this team, and which entry of the priority
    map says so: the most specific of user:<name>, team:<slug> and the role wins; operators are not
    limited; principals the map does not mention get TELEMACHUS_PRIORITY_CEILING."""
    if who.operator:
        return Job.PRIORITY_MAX, "operator"
    for key in (f"user:{who.username}", f"team:{team.slug}", who.role(team)):
        if key in record.priority_map:
            return int(record.priority_map[key]), f"priority_map[{key!r}]"
    return settings.TELEMACHUS_PRIORITY_CEILING, "TELEMACHUS_PRIORITY_CEILING"
