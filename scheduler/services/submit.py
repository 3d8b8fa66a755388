"""Admission: from a request to a queued job (or a refusal), at the speed of the API.

The checks read only configuration (teams, memberships, permissions, executors, quota rules, the
queue policy), kept per configuration version (scheduler/core/configuration.py). The version is
confirmed by the statement that locks the team rows, so an unchanged configuration costs no
round trip; if it moved since the process last read it, the submit reads it again and checks
again. What must be live is read live: the budget ledger (only when a budget applies) and the
queue depth, which PostgreSQL keeps per team in a tally (scheduler/migrations/0015_queue_tally.py)
so that no submit counts the queue.

Round trips per submit (tests/scheduler/services/test_submit.py pins them):
  PostgreSQL, no budget, the default admission: one statement, which commits by itself: it locks
      the team rows and then their tally rows, confirms the version, inserts the jobs and their
      events only if the queues have room, and wakes the workers (`_write_at_once`).
  otherwise (a budget, a policy with an admission of its own, SQLite; and on PostgreSQL a refusal
      or a moved configuration, to say why): BEGIN; the team lock, which also confirms the version,
      reads the ledger rows and queues the workers' wake-up; the depth (the tally, or a count on
      SQLite); the job insert; the event insert; COMMIT (`_write_checked`)."""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models import TextField, Value
from django.utils import timezone

from executors.contract import EMBEDDINGS_API
from executors.models import Executor
from quotas.budget import Budgets, admission_budgets, quota_check
from quotas.models import ZERO
from scheduler.core.configuration import Configuration, configuration, grants, policy_record
from scheduler.core.estimates import job_estimate
from scheduler.core.jobtypes import MODEL_CALL_TYPES, TASK_TYPES, job_input_check
from scheduler.core.money import job_money_estimate, token_split_estimate
from scheduler.core.policy import Admission, AdmissionState, BaseQueuePolicy, policy_for
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.rbac import JOB_TYPE_PERMISSION
from scheduler.services.events import events_record, job_event
from telemachus.control import notify
from telemachus.control.config import (
    ConfigSnapshot,
    config_at,
    config_current,
    config_reload,
    config_snapshot,
    version_annotation,
)
from telemachus.control.features import feature_require
from telemachus.errors import DomainError, TryLater, UnknownModel, ValidationFailed
from telemachus.locks import Level, for_update_sql, rows_lock
from telemachus.models import ApiKey, ConfigVersion, Team
from telemachus.teams import rbac

# The most jobs one bulk submit may carry.
MAX_BULK = 1000


@dataclass(frozen=True)
class JobSpec:
    """One job to submit, shape-checked (JobSubmitInput)."""

    team: str
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


def job_submit(
    *,
    user: rbac.Principal,
    team: str,
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
    call of that session in its team (one more query, only with a key)."""
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
    )
    (job,) = _submit(user=user, specs=[spec], key=key, wake=wake)
    return job


def jobs_submit(*, user: rbac.Principal, jobs: Sequence[JobSpec], key: ApiKey | None = None) -> list[Job]:
    """Submit up to MAX_BULK jobs at once, all or nothing: each is checked as `job_submit` checks
    it, and the queue depth cap counts the whole batch (a team's queued jobs plus those of the
    batch before each one). One transaction; team rows locked in ascending id. A refusal names
    the failing job's position in `index` and nothing is written."""
    if not 1 <= len(jobs) <= MAX_BULK:
        raise ValidationFailed({"jobs": [f"Between 1 and {MAX_BULK} jobs."]})
    return _submit(user=user, specs=jobs, indexed=True, key=key)


class _StaleConfiguration(Exception):
    def __init__(self, version: int | None) -> None:
        self.version = version


@dataclass
class _Admitted:
    """A job that passed the configuration checks, before the live ones."""

    job: Job
    requested: int
    allowed: int
    source: str
    # The executors that could take it (for its money estimate against `ai.cost` budgets).
    executors: list[Executor] = field(default_factory=list)


def _submit(
    *,
    user: rbac.Principal,
    specs: Sequence[JobSpec],
    indexed: bool = False,
    key: ApiKey | None = None,
    wake: bool = True,
) -> list[Job]:
    """Check against the configuration this process last read; confirm its version under the team
    locks. A refusal from configuration that may be stale is checked again on a fresh read
    before it is believed."""
    snapshot, fresh = config_current()
    while True:
        try:
            return _admit(user=user, specs=specs, snapshot=snapshot, indexed=indexed, key=key, wake=wake)
        except _StaleConfiguration as stale:
            # The same version with different rows can only be a rolled-back or flushed database.
            same = (stale.version or 0) == snapshot.version
            snapshot, fresh = (config_reload if same else config_at)(stale.version), True
        except DomainError:
            if fresh:
                raise
            snapshot, fresh = config_snapshot(), True


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
    teams = sorted({item.job.team_id for item in admitted})
    subjects = {(item.job.team_id, item.job.user_id) for item in admitted}
    budgets = admission_budgets(subjects=subjects, now=now, rules=conf.admission_rules(subjects))
    if connection.vendor == "postgresql" and not budgets.accounts and _default_admission(record):
        _sessions_continue([item.job for item in admitted])
        jobs = _write_at_once(admitted, record=record, teams=teams, version=snapshot.version, now=now, wake=wake)
        if jobs is not None:
            return jobs
        # Refused, or the configuration moved: the checks below say which, and why.
    with transaction.atomic():
        return _write_checked(
            admitted,
            record=record,
            teams=teams,
            budgets=budgets,
            snapshot=snapshot,
            now=now,
            indexed=indexed,
            wake=wake,
        )


def _write_checked(
    admitted: list[_Admitted],
    *,
    record: QueuePolicy,
    teams: list[int],
    budgets: Budgets,
    snapshot: ConfigSnapshot,
    now: datetime,
    indexed: bool,
    wake: bool,
) -> list[Job]:
    """The live checks in Python (budgets, a custom policy's admission), then the writes, in the
    caller's transaction."""
    # One statement: lock the teams' rows (reading their queues is then race-free), confirm the
    # configuration version, read the budgets' ledger rows, and wake the workers on commit.
    budget_columns = budgets.columns()
    wakeup = notify.notify_column(notify.QUEUED) if wake else Value("", output_field=TextField())
    locked = list(
        rows_lock(Team.objects, level=Level.CONFIGURATION, of=("self",))
        .filter(pk__in=teams)
        .order_by("pk")
        .annotate(config_version=version_annotation(), wake=wakeup, **budget_columns)
        .values("pk", "config_version", "wake", *budget_columns)
    )
    version = locked[0]["config_version"] if locked else None
    if len(locked) != len(teams) or (version or 0) != snapshot.version:
        raise _StaleConfiguration(version)
    budgets.fill(locked[0])
    _within_budgets(budgets, admitted, now, indexed=indexed)
    _within_depth(record, admitted, now, indexed=indexed, depths=_depths(teams))
    _sessions_continue([item.job for item in admitted])
    jobs = Job.objects.bulk_create([item.job for item in admitted])
    events_record(
        job_event(job=item.job, event=event, at=now, **meta)
        for item in admitted
        for event, meta in _submit_events(item)
    )
    return jobs


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
        team = who.team_for_submit(conf.team(spec.team), spec.team)
        for feature in (*spec.features, spec.type):
            feature_require(feature=feature, team=team, switches=conf.features)
        who.require(JOB_TYPE_PERMISSION[spec.type], team=team)
        job_input_check(
            type=spec.type, input=spec.input, team=team, require=lambda permission: who.require(permission, team=team)
        )
        # A tool job runs in a worker's tool threads, on no executor: it names no model.
        model = "" if spec.type == Job.Type.TOOL else spec.requirements["model"]
        if key is not None and model and key.allowed_models and model not in key.allowed_models:
            raise UnknownModel(
                f"This API key may not call model {model!r}; it may call {', '.join(map(repr, key.allowed_models))}.",
                model=model,
            )
        usable = (
            _placeable(conf, team=team, type=spec.type, model=model, requirements=spec.requirements) if model else []
        )
        allowed, source = priority_ceiling(record, who=who, team=team)
        if spec.priority > allowed and record.priority_over_limit == QueuePolicy.OverLimit.REJECT:
            raise ValidationFailed({"priority": [f"At most {allowed} for you in team {team.slug!r} ({source})."]})
    except DomainError as exc:
        raise _at(exc, index) from None
    # A job deferred to `run_after` enters the line, and starts ageing, when it may run.
    ready = max(now, spec.run_after) if spec.run_after else now
    # The submitter's est_tokens, else a real estimate (scheduler/core/estimates.py), never 0.
    estimate = job_estimate(type=spec.type, model=model, requirements=spec.requirements, input=spec.input)
    prompt, completion = token_split_estimate(
        type=spec.type, requirements=spec.requirements, input=spec.input, estimate=estimate
    )
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
    )
    return _Admitted(job=job, requested=spec.priority, allowed=allowed, source=source, executors=usable)


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


def _within_depth(
    record: QueuePolicy, admitted: list[_Admitted], now: datetime, *, indexed: bool, depths: dict[int, int]
) -> None:
    """The policy's admission, with each team's queue read (`depths`, the tally) or counted once,
    and the batch's own jobs ahead of each one counted as queued."""
    policy = policy_for(record)
    states: dict[int, AdmissionState] = {}
    ahead: Counter[int] = Counter()
    for i, item in enumerate(admitted):
        team = item.job.team
        state = states.setdefault(team.pk, AdmissionState(team=team, now=now, queued=depths.get(team.pk)))
        state.pending = ahead[team.pk]
        admission = policy.admit(item.job, state)
        if admission.decision == Admission.REJECT:
            raise _at(TryLater(admission.reason, retry_after=admission.retry_after or 60), i if indexed else None)
        ahead[team.pk] += 1


def _default_admission(record: QueuePolicy) -> bool:
    """Whether the policy in force admits as BaseQueuePolicy does (the depth cap alone), which the
    one-statement submit checks in SQL; a policy with an admission of its own is asked in Python."""
    return type(policy_for(record)).admit is BaseQueuePolicy.admit


# The depth of a team's queue from its tally rows (scheduler/migrations/0015_queue_tally.py), with
# what this transaction changed and has not applied yet (the tally is written at commit).
_TALLY_DEPTH = "i.n - o.n + scheduler_queue_noted(i.team_id, 'in') - scheduler_queue_noted(i.team_id, 'out')"


def _depths(teams: list[int]) -> dict[int, int]:
    """Each team's queue depth from the tally, read after the team locks (PostgreSQL): a statement
    of its own, so it sees every submit that held the locks before; a tally that is missing (or
    SQLite) leaves the team out, and admission counts its queue instead."""
    if connection.vendor != "postgresql":
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT i.team_id, {_TALLY_DEPTH} FROM scheduler_queue_tally i "
            "JOIN scheduler_queue_tally o ON o.team_id = i.team_id AND o.side = 'out' "
            f"WHERE i.side = 'in' AND i.team_id IN ({', '.join(['%s'] * len(teams))})",
            teams,
        )
        return dict(cursor.fetchall())


class _PreparedCursor(psycopg.Cursor):
    """Binds parameters on the server and prepares the statement on its first use on a connection,
    so the one statement of a submit is planned once per connection, not at every submit (a
    quarter of a millisecond: it is long). Not behind PgBouncer in transaction pooling, which
    would run it on a server connection that never saw it prepared (settings.py)."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Any:
        prepare = not settings.TELEMACHUS_PGBOUNCER if prepare is None else prepare
        return super().execute(query, params, prepare=prepare, binary=binary)


_JOB_FIELDS = [f for f in Job._meta.concrete_fields if not f.primary_key]
# Each column's conversion, bound once. About 14 of a submitted job's 36 columns are empty (None),
# which every field here stores as NULL without converting (tests/scheduler/services/test_submit.py).
_JOB_PREPS = [(f.attname, f.get_db_prep_save) for f in _JOB_FIELDS]
_EVENT_META = JobEvent._meta.get_field("meta")


@lru_cache(maxsize=64)
def _at_once_sql(jobs: int, teams: int, events: int, wake: bool, pending: bool) -> str:
    """The one statement of `_write_at_once`, for this many jobs, teams and events; `pending`:
    inside a transaction, which may have changed the queue (autocommit has nothing pending)."""
    qn = connection.ops.quote_name
    job_table, event_table = qn(Job._meta.db_table), qn(JobEvent._meta.db_table)
    row = "(" + ", ".join(f"%s::{f.cast_db_type(connection)}" for f in _JOB_FIELDS) + ")"
    columns = ", ".join(qn(str(f.column)) for f in _JOB_FIELDS)
    depth = _TALLY_DEPTH if pending else "i.n - o.n"
    wakeup = (
        f"CASE WHEN (SELECT ok FROM go) THEN pg_notify('{notify.WORKERS_CHANNEL}', '{notify.QUEUED}') END"
        if wake
        else "NULL"
    )
    return (
        # Each team's row (level 0), then its `in` tally row (level 6, nothing is locked after
        # it), in ascending team order (the VALUES list is sorted); a row another transaction
        # changed is read again at its latest.
        f"WITH depth AS (SELECT t.id, {depth} AS queued, w.room FROM (VALUES "
        + ", ".join(["(%s::bigint, %s::bigint)"] * teams)
        + f") AS w (team_id, room) JOIN {qn(Team._meta.db_table)} t ON t.id = w.team_id "
        "JOIN scheduler_queue_tally i ON i.team_id = t.id AND i.side = 'in' "
        "JOIN scheduler_queue_tally o ON o.team_id = t.id AND o.side = 'out' "
        "ORDER BY t.id" + for_update_sql(level=Level.CONFIGURATION, of="t, i") + "), "
        "go AS (SELECT coalesce((SELECT version FROM "
        f"{qn(ConfigVersion._meta.db_table)} WHERE id = {ConfigVersion.SINGLETON_ID}), 0) = %s "
        "AND count(*) = %s AND coalesce(bool_and(queued <= room), false) AS ok FROM depth), "
        f"inserted AS (INSERT INTO {job_table} ({columns}) SELECT * FROM (VALUES "
        + ", ".join([row] * jobs)
        + ") AS v WHERE (SELECT ok FROM go) RETURNING id), "
        f"recorded AS (INSERT INTO {event_table} ({qn('job_id')}, {qn('executor_id')}, {qn('event')}, {qn('at')}, "
        f"{qn('meta')}) SELECT j.id, NULL, e.event, %s, e.meta "
        "FROM (SELECT id, row_number() OVER (ORDER BY id) AS ord FROM inserted) AS j JOIN (VALUES "
        + ", ".join(["(%s::bigint, %s::varchar, %s::jsonb)"] * events)
        + ") AS e (ord, event, meta) ON e.ord = j.ord) "
        f"SELECT (SELECT ok FROM go), {wakeup}, ARRAY(SELECT id FROM inserted ORDER BY id)"
    )


def _write_at_once(
    admitted: list[_Admitted], *, record: QueuePolicy, teams: list[int], version: int, now: datetime, wake: bool
) -> list[Job] | None:
    """Write the jobs and their events in one statement, which commits by itself outside a
    transaction (PostgreSQL, no budget, the default admission). It locks the teams' rows, then
    their `in` tally rows (reading them at their latest, whatever this statement's snapshot: two
    submits of a team are serialized by the lock, and the second sees the first's job), confirms
    the configuration version, and inserts only if each team's queue has room for its jobs (what
    BaseQueuePolicy.admit decides); the NOTIFY that wakes the workers goes with them. None when it
    wrote nothing (a full queue, a stale configuration, a tally missing): the checked path decides
    then, and says why."""
    db = connections[DEFAULT_DB_ALIAS]  # not the proxy: the fields' conversions read it often
    jobs = [item.job for item in admitted]
    batch = Counter(job.team_id for job in jobs)
    slugs = {job.team_id: job.team.slug for job in jobs}
    params: list[Any] = []
    for team_id in teams:
        params += [team_id, record.queue_depth_limit(slugs[team_id]) - batch[team_id]]
    params += [version, len(teams)]
    for job in jobs:
        values = job.__dict__  # built by _check: every field is set
        params += [None if (value := values[attname]) is None else prep(value, db) for attname, prep in _JOB_PREPS]
    params.append(now)
    events = 0
    for ord, item in enumerate(admitted, start=1):
        for event, meta in _submit_events(item):
            params += [ord, event, _EVENT_META.get_db_prep_save(meta, db)]
            events += 1
    db.ensure_connection()
    # Through Django's wrapper, so it is logged and wrapped like any query.
    wrapper = CursorDebugWrapper if db.queries_logged else CursorWrapper
    with wrapper(_PreparedCursor(db.connection), db) as cursor:
        cursor.execute(_at_once_sql(len(jobs), len(teams), events, wake, not db.get_autocommit()), params)
        ok, _, ids = cursor.fetchone()
    if not ok:
        return None
    for job, pk in zip(jobs, ids, strict=True):
        job.pk = pk
        job._state.adding, job._state.db = False, db.alias
    return jobs


def _submit_events(item: _Admitted) -> list[tuple[str, dict[str, Any]]]:
    """A submitted job's events: `queued` (with its not-before time, if deferred), and
    `priority_clamped` when the priority map lowered what it asked for."""
    job = item.job
    queued: dict[str, Any] = {"priority": job.priority}
    if job.run_after is not None:
        queued["run_after"] = job.run_after.isoformat()
    events = [(JobEvent.Type.QUEUED.value, queued)]
    if item.requested > item.allowed:
        clamped = {"requested": item.requested, "allowed": item.allowed, "reason": item.source}
        events.append((JobEvent.Type.PRIORITY_CLAMPED.value, clamped))
    return events


def _at(exc: DomainError, index: int | None) -> DomainError:
    """The error, naming the failing job's position in a bulk submit."""
    if index is not None:
        exc.extra["index"] = index
    return exc


def priority_ceiling(record: QueuePolicy, *, who: rbac.Grants, team: Team) -> tuple[int, str]:
    """The highest priority this principal may use in this team, and which entry of the priority
    map says so: the most specific of user:<name>, team:<slug> and the role wins; operators and
    principals the map does not mention are not limited."""
    if who.operator:
        return Job.PRIORITY_MAX, "operator"
    for key in (f"user:{who.username}", f"team:{team.slug}", who.role(team)):
        if key in record.priority_map:
            return int(record.priority_map[key]), f"priority_map[{key!r}]"
    return Job.PRIORITY_MAX, "no limit"
