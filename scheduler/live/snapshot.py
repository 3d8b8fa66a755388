"""The live state of the queue (GET /api/queue/, the dashboard): depth per team with its fair share
and why it is not being served, slots in use per scope against caps, executors; for the dashboard
also the page of jobs it asked for (with why each queued one waits), the policy and the feature switches.

Each picture is read in one snapshot (telemachus/db/snapshots.py `consistent_read`), so running
counts, slots and the job list always agree with each other."""

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models import DurationField, ExpressionWrapper, F, OuterRef, Subquery, Sum, Value
from django.db.models.functions import Coalesce, Greatest
from django.urls import reverse
from django.utils import timezone

from executors.models import Executor, ModelRoute
from executors.selectors import executor_serves, executor_teams
from quotas.budget import Budgets
from quotas.concurrency import ConcurrencyCaps, SlotCounts, concurrency_caps, executor_limit
from quotas.models import QuotaPolicy
from quotas.rules import quota_rules
from scheduler.batches.models import Batch
from scheduler.batches.services import batch_counts
from scheduler.core.configuration import queue_policy
from scheduler.core.policy import policy_for
from scheduler.core.selectors import jobs_running, policy_seen_by, queue_depths, slot_counts
from scheduler.live.joblist import PAGE_SIZE, JobView, jobs_page
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.history import bucket_start, first_start_waits, waits_summary
from scheduler.services.policy import EDITABLE
from scheduler.services.retention import retention_overview
from telemachus.control.features import feature_states
from telemachus.db.snapshots import consistent_read
from telemachus.models import ApiKey, Team
from telemachus.teams import rbac

RECENT_JOBS = PAGE_SIZE
POLICY_CHOICES = {
    field.name: [value for value, _ in field.choices]  # type: ignore[union-attr]
    for field in QueuePolicy._meta.get_fields()
    if field.name in EDITABLE and getattr(field, "choices", None)
}
# What each editable setting does, as the admin shows it under the field: the page shows it beside.
POLICY_HELP = {name: str(getattr(QueuePolicy._meta.get_field(name), "help_text", "")) for name in EDITABLE}


@dataclass
class Cluster:
    """What the wait reasons are judged against: caps, live slots, budgets, every executor."""

    now: datetime
    record: QueuePolicy
    caps: ConcurrencyCaps
    slots: SlotCounts
    budgets: Budgets
    executors: list[Executor]
    executor_teams: dict[int, set[int]]
    routes: list[ModelRoute]

    @classmethod
    def load(cls, *, now: datetime) -> "Cluster":
        rules = quota_rules()
        return cls(
            now=now,
            record=queue_policy(),
            caps=concurrency_caps(rules),
            slots=slot_counts(),
            budgets=Budgets.load(now=now, rules=rules),
            executors=list(Executor.objects.select_related("team")),
            executor_teams=executor_teams(),
            routes=list(ModelRoute.objects.all()),
        )

    def limit(self, executor: Executor) -> int:
        return executor_limit(name=executor.name, max_concurrency=executor.max_concurrency, caps=self.caps)

    def usable_by(self, executor: Executor, team_id: int) -> bool:
        return executor_serves(executor, team_id, self.executor_teams)


def wait_reasons(cluster: Cluster, *, team_id: int, model: str, user_id: int) -> list[dict[str, Any]]:
    """Why a queued job (of this team, user and model) is not started now: each reason a code, a
    sentence for people, and its particulars. Empty when nothing stands in its way (the next
    claim takes it, or it waits its turn by priority and fair share)."""
    reasons: list[dict[str, Any]] = []

    def add(code: str, text: str, **extra: Any) -> None:
        reasons.append({"code": code, "text": text, **extra})

    caps, slots = cluster.caps, cluster.slots
    if team_id in caps.team and slots.team[team_id] >= caps.team[team_id]:
        add("team_cap", "at team cap", cap=caps.team[team_id])
    if user_id in caps.user and slots.user[user_id] >= caps.user[user_id]:
        key_id = next((k for k, u in caps.key_users.items() if u == user_id), None)
        if key_id is not None:  # an API key acts as a user of its own: its cap is that user's
            add("key_cap", "at API key cap", cap=caps.user[user_id], key=key_id)
        else:
            add("user_cap", "at user cap", cap=caps.user[user_id])
    if caps.global_cap is not None and slots.total >= caps.global_cap:
        add("global_cap", "at global cap", cap=caps.global_cap)
    for account in cluster.budgets.applicable(team_id=team_id, user_id=user_id):
        if account.remaining <= 0 and account.rule.scope != QuotaPolicy.Scope.EXECUTOR:
            who = f"{account.rule.scope} {account.rule.subject}".rstrip()
            add(
                "budget_empty",
                f"over budget: {who} {account.rule.dimension} empty until {account.end:%Y-%m-%d %H:%M} UTC",
                scope=account.rule.scope,
                dimension=account.rule.dimension,
                reset_at=account.end.isoformat(),
            )
    offering = [e for e in cluster.executors if model in e.offered_models and cluster.usable_by(e, team_id)]
    blocked: list[tuple[str, str, Executor, dict[str, Any]]] = []
    for executor in offering:
        if not executor.enabled:
            blocked.append(("executor_disabled", f"executor {executor.name} is disabled", executor, {}))
        elif executor.health == Executor.Health.DOWN:
            blocked.append(("executor_down", f"executor {executor.name} is down", executor, {}))
        elif (
            executor.breaker == Executor.Breaker.OPEN
            and executor.breaker_until
            and executor.breaker_until > cluster.now
        ):
            blocked.append(
                (
                    "executor_breaker_open",
                    f"executor {executor.name}: breaker open until {executor.breaker_until:%H:%M:%S} UTC",
                    executor,
                    {"until": executor.breaker_until.isoformat()},
                )
            )
        elif cluster.limit(executor) <= 0:
            rule = " (an executor concurrency rule)" if executor.max_concurrency > 0 else ""
            blocked.append(
                (
                    "executor_no_capacity",
                    f"executor {executor.name} has capacity 0{rule}",
                    executor,
                    {"limit": 0, "max_concurrency": executor.max_concurrency},
                )
            )
        elif slots.executor[executor.pk] >= cluster.limit(executor):
            blocked.append(
                ("executor_full", f"executor {executor.name} is full", executor, {"limit": cluster.limit(executor)})
            )
    if not offering:
        add("no_executor", "no executor offers the model", model=model)
    elif len(blocked) == len(offering):  # every executor that could take it is out of reach
        for code, text, blocker, extra in blocked:
            add(code, text, executor=blocker.name, model=model, **extra)
    return reasons


def slot_seconds(*, since: datetime, now: datetime) -> dict[int, float]:
    """Slot-seconds each team held since `since`: the slots held now (from their `acquired_at`),
    and jobs that ended in the window, from their start. A flow's earlier rounds (its
    `started_at` is its first round's) are counted by their `round_finished` events' seconds
    instead, so the time between its rounds, when it held no slot, is not."""
    totals: dict[int, float] = defaultdict(float)
    held = ExpressionWrapper(Value(now) - Greatest(F("acquired_at"), Value(since)), output_field=DurationField())
    for team_id, span in (
        Slot.objects.order_by().values_list("team_id").annotate(held=Coalesce(Sum(held), timedelta(0)))
    ):
        totals[team_id] += span.total_seconds()
    ended = ExpressionWrapper(F("finished_at") - Greatest(F("started_at"), Value(since)), output_field=DurationField())
    for team_id, span in (
        Job.objects.filter(finished_at__gte=since, started_at__isnull=False)
        .exclude(type=Job.Type.FLOW)
        .order_by()
        .values_list("team_id")
        .annotate(held=Coalesce(Sum(ended), timedelta(0)))
    ):
        totals[team_id] += span.total_seconds()
    rounds = JobEvent.objects.filter(event=JobEvent.Type.ROUND_FINISHED, at__gte=since, job__type=Job.Type.FLOW)
    for team_id, seconds in rounds.values_list("job__team_id", "meta__seconds"):
        totals[team_id] += float(seconds or 0)
    return totals


def queue_heads(team_ids: list[int]) -> dict[int, tuple[str, int]]:
    """The (model, user id) of each team's next queued job by priority, then readiness: one query with
    a lookup per team on its queue index. Tool jobs need no executor, so they never wait for one."""
    if not team_ids:
        return {}
    head = (
        Job.objects.filter(team=OuterRef("pk"), status=Job.Status.QUEUED)
        .exclude(type=Job.Type.TOOL)
        .order_by("-priority", "ready_at", "id")
    )
    rows = (
        Team.objects.filter(pk__in=team_ids)
        .annotate(
            head_model=Subquery(head.values("model")[:1]),
            head_user=Subquery(head.values("user_id")[:1]),
        )
        .values_list("pk", "head_model", "head_user")
    )
    return {team_id: (model, user_id) for team_id, model, user_id in rows if model is not None}


def _team_rows(cluster: Cluster, teams: list[Team]) -> list[dict[str, Any]]:
    """Each team's queue and running jobs, slots against its cap, its share of capacity (target,
    if busy, actual) and why its queue is not being served."""
    now, record, caps, slots = cluster.now, cluster.record, cluster.caps, cluster.slots
    policy = policy_for(record)
    depth: Counter[tuple[int, str]] = Counter()
    for status, counts in ((Job.Status.QUEUED, queue_depths()), (Job.Status.RUNNING, jobs_running())):
        for team_id, n in counts.items():
            if n:
                depth[team_id, status] = n
    active = {team_id for team_id, _ in depth}
    weights = {t.pk: record.weight(t.slug) for t in Team.objects.filter(pk__in=active)}
    total_weight = sum(w for w in weights.values() if w > 0)
    used = slot_seconds(since=now - timedelta(seconds=record.share_window_seconds), now=now)
    total_used = sum(used.values())
    heads = queue_heads([t.pk for t in teams if depth[t.pk, Job.Status.QUEUED]])

    def waits(team: Team) -> list[dict[str, Any]]:
        queued = depth[team.pk, Job.Status.QUEUED]
        reasons: list[dict[str, Any]] = []
        if team.pk in heads:
            model, user_id = heads[team.pk]
            reasons = wait_reasons(cluster, team_id=team.pk, model=model, user_id=user_id)
        depth_limit = policy.queue_room(team)
        if queued >= depth_limit:
            reasons.append(
                {
                    "code": "depth_cap",
                    "text": f"queue at its depth cap ({depth_limit}): new jobs are refused",
                    "cap": depth_limit,
                }
            )
        return reasons

    rows = []
    for team in teams:
        reasons = waits(team)
        rows.append(
            {
                "team": team.slug,
                "queued": depth[team.pk, Job.Status.QUEUED],
                "running": depth[team.pk, Job.Status.RUNNING],
                "in_use": slots.team[team.pk],
                "cap": caps.team.get(team.pk),
                "weight": record.weight(team.slug),
                "target_share": round(weights.get(team.pk, 0) / total_weight, 4)
                if team.pk in active and weights.get(team.pk, 0) > 0
                else 0.0,
                # An idle team's target share is 0; this is what it would get if it had work now.
                "share_if_busy": _share_if_busy(record.weight(team.slug), team.pk in active, total_weight),
                "actual_share": round(used[team.pk] / total_used, 4) if total_used else 0.0,
                # Retention in force (docs/retention.md): its own, else the deployment's.
                "retention_hours": team.retention_hours
                if team.retention_hours is not None
                else settings.TELEMACHUS_RETENTION_HOURS,
                "body_retention_hours": team.body_retention_hours,
                "not_served": [reason["text"] for reason in reasons],
                "waits": reasons,
            }
        )
    return rows


def queue_snapshot(*, user: rbac.Principal, cluster: Cluster | None = None) -> dict[str, Any]:
    """Operators see everything; others see their own teams, themselves, and the executors their
    teams may use. Read in one transaction unless the caller holds one."""
    with consistent_read():
        return _queue_snapshot(user=user, cluster=cluster or Cluster.load(now=timezone.now()))


def _queue_snapshot(*, user: rbac.Principal, cluster: Cluster) -> dict[str, Any]:
    caps, slots = cluster.caps, cluster.slots
    operator = rbac.is_operator(user)
    teams = list(rbac.visible_teams(user).order_by("slug"))
    team_rows = _team_rows(cluster, teams)
    executors = [e for e in cluster.executors if operator or e.team_id is None or e.team_id in {t.pk for t in teams}]
    keys = list(
        ApiKey.objects.filter(team__in=[t.pk for t in teams], revoked_at__isnull=True)
        .select_related("team")
        .order_by("team__slug", "name")
    )
    key_users = {key.principal_id for key in keys} | set(caps.key_users.values())
    user_ids = (set(caps.user) | set(slots.user)) - key_users if operator else {user.pk}
    usernames = dict(get_user_model().objects.filter(pk__in=user_ids).values_list("pk", "username"))  # type: ignore[misc]
    return {
        "global": {"in_use": slots.total, "cap": caps.global_cap},
        "teams": team_rows,
        "batches": _batch_rows(teams),
        "users": [
            {"user": usernames[uid], "in_use": slots.user[uid], "cap": caps.user.get(uid)}
            for uid in sorted(usernames, key=usernames.get)  # type: ignore[arg-type]
        ],
        # Apps' API keys of the teams shown: each acts as a user of its own, whose slots are the key's.
        "keys": [
            {
                "id": key.pk,
                "name": key.name,
                "prefix": key.prefix,
                "team": key.team.slug,
                "models": list(key.allowed_models),
                "expires_at": key.expires_at,
                "last_used_at": key.last_used_at,
                "in_use": slots.user[key.principal_id] if key.principal_id else 0,
                "cap": caps.key.get(key.pk),
            }
            for key in keys
        ],
        # Model routes (docs/routing.md), read-only: edited through /api/routes/ or the admin.
        "routes": [{"name": r.name, "models": list(r.models)} for r in cluster.routes],
        "executors": [
            {
                "id": e.pk,
                "name": e.name,
                "kind": e.kind,
                "team": e.team.slug if e.team else None,
                "enabled": e.enabled,
                "health": e.health,
                "breaker": e.breaker,
                "breaker_until": e.breaker_until,
                "models": e.offered_models,
                "in_use": slots.executor[e.pk],
                "limit": cluster.limit(e),
                "max_concurrency": e.max_concurrency,
            }
            for e in executors
        ],
    }


def _batch_rows(teams: list[Team]) -> list[dict[str, Any]]:
    """The batches under way of the teams shown, each with its progress (docs/batches.md)."""
    rows = []
    for batch in Batch.objects.filter(team__in=teams, status__in=Batch.ACTIVE).select_related("team"):
        counts = batch_counts(batch=batch)
        rows.append(
            {
                "id": batch.pk,
                "team": batch.team.slug,
                "api": batch.api,
                "status": batch.status,
                "total": counts.total,
                "completed": counts.completed,
                "failed": counts.failed,
                "running": counts.running,
                "expires_at": batch.expires_at,
            }
        )
    return rows


def queue_waits(*, now: datetime) -> dict[str, Any]:
    """The queue wait as the dashboard's tile and the right edge of its wait chart show it: the
    p50 and p95 of the jobs that first started in the open history bucket so far (`since`), the
    same measure the bucket's row will hold when it closes (scheduler/services/history.py), and
    when the job waiting longest now entered the queue (`oldest_queued_at`, None when none
    waits), so a wait that has not ended yet shows too. For the whole queue, like the history's
    whole-queue series. One read of the bucket's starts through the events index, and one
    indexed lookup per team (job_team_wait_idx) for the oldest queued job."""
    since = bucket_start(now)
    waits = first_start_waits(start=since, end=now)
    queued = Job.objects.filter(team=OuterRef("pk"), status=Job.Status.QUEUED).order_by("queued_at", "id")
    entered = Team.objects.annotate(oldest=Subquery(queued.values("queued_at")[:1])).values_list("oldest", flat=True)
    return {
        "since": since,
        **waits_summary([w for team_waits in waits.values() for w in team_waits]),
        "oldest_queued_at": min((at for at in entered if at is not None), default=None),
    }


def _share_if_busy(weight: float, active: bool, total_weight: float) -> float:
    if weight <= 0:
        return 0.0
    return round(weight / (total_weight if active else total_weight + weight), 4)


def dashboard_state(*, user: rbac.Principal, view: JobView | None = None) -> dict[str, Any]:
    """What the live dashboard shows, all from one snapshot: the queue, the page of jobs the page
    asked for (scheduler/live/joblist.py; each queued one with why it waits), how many jobs each tab
    holds, and for the controls the queue policy and the feature switches."""
    view = view or JobView()
    with consistent_read():
        cluster = Cluster.load(now=timezone.now())
        queue = _queue_snapshot(user=user, cluster=cluster)
        page = jobs_page(user=user, view=view)
        operator = rbac.is_operator(user)
        return {
            "operator": operator,
            "queue": queue,
            "jobs": [_job_row(job, cluster, staff=user.is_staff) for job in page["jobs"]],
            "jobs_total": page["total"],
            "jobs_counts": page["counts"],
            "jobs_count_limit": page["count_limit"],
            "jobs_next": page["next"],
            "jobs_view": view.as_dict(),
            "jobs_link": reverse("admin:scheduler_job_changelist") if user.is_staff else reverse("job-list"),
            "policy": policy_seen_by(user, {name: getattr(cluster.record, name) for name in EDITABLE}),
            "policy_choices": POLICY_CHOICES,
            "waits": queue_waits(now=cluster.now),
            "features": feature_states(teams=rbac.visible_teams(user).order_by("slug")),
            "retention": retention_overview() if operator else None,
        }


def _job_row(job: Job, cluster: Cluster, *, staff: bool) -> dict[str, Any]:
    waits: list[dict[str, Any]] = []
    if job.status == Job.Status.QUEUED:
        waits = wait_reasons(cluster, team_id=job.team_id, model=job.model, user_id=job.user_id)
        if job.run_after and job.run_after > cluster.now:
            waits.append(
                {
                    "code": "retry_backoff",
                    "text": f"retrying after {job.run_after:%H:%M:%S} UTC",
                    "until": job.run_after.isoformat(),
                }
            )
    return {
        "id": job.pk,
        "team": job.team.slug,
        "user": job.user.get_username(),
        "type": job.type,
        "model": job.model,
        "priority": job.priority,
        "status": job.status,
        "round": job.current_round,
        "round_label": job.round_label,
        "executor": job.executor.name if job.executor else None,
        "attempts": job.attempts,
        "tokens_used": job.tokens_used,
        "submitted_at": job.submitted_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "error": job.error[:200],
        "waits": [w["text"] for w in waits],
        "link": reverse("admin:scheduler_job_change", args=[job.pk]) if staff else reverse("job-detail", args=[job.pk]),
    }
