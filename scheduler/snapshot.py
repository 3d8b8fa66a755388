"""The live state of the queue (GET /api/queue/, the dashboard): depth per team with its fair share
and why it is not being served, slots in use per scope against caps, executors."""

from collections import Counter
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import Count, DurationField, ExpressionWrapper, F, OuterRef, Subquery, Sum, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from executors.models import Executor
from executors.selectors import models_usable_by
from quotas.budget import Budgets
from quotas.concurrency import concurrency_caps, executor_limit, slot_counts
from quotas.models import QuotaPolicy
from quotas.rules import quota_rules
from scheduler.models import Job
from scheduler.selectors import queue_policy
from telemachus import rbac
from telemachus.models import Team


def queue_snapshot(*, user: rbac.Principal) -> dict[str, Any]:
    """Operators see everything; others see their own teams, themselves, and the executors their
    teams may use."""
    now = timezone.now()
    rules = quota_rules()
    caps, slots, budgets = concurrency_caps(rules), slot_counts(), Budgets.load(now=now, rules=rules)
    record = queue_policy()
    operator = rbac.is_operator(user)
    teams = list(rbac.visible_teams(user).order_by("slug"))
    depth: Counter = Counter()
    for team_id, status, n in (
        Job.objects.filter(status__in=[Job.Status.QUEUED, Job.Status.RUNNING]).order_by()
        .values_list("team_id", "status").annotate(n=Count("id"))
    ):
        depth[team_id, status] = n
    active = {team_id for team_id, _ in depth}
    weights = {t.pk: record.weight(t.slug) for t in Team.objects.filter(pk__in=active)}
    total_weight = sum(w for w in weights.values() if w > 0)
    used = slot_seconds(since=now - timedelta(seconds=record.share_window_seconds), now=now)
    total_used = sum(used.values())
    out_of_budget = budgets.exhausted(QuotaPolicy.Scope.TEAM)
    waiting = [t.pk for t in teams if depth[t.pk, Job.Status.QUEUED]]
    heads, usable = queue_heads(waiting), models_usable_by(waiting)

    executors = Executor.objects.select_related("team").order_by("name")
    if not operator:
        executors = executors.filter(team__isnull=True) | executors.filter(team_id__in=[t.pk for t in teams])
    user_ids = set(caps.user) | set(slots.user) if operator else {user.pk}
    usernames = dict(get_user_model().objects.filter(pk__in=user_ids).values_list("pk", "username"))
    return {
        "global": {"in_use": slots.total, "cap": caps.global_cap},
        "teams": [
            {
                "team": team.slug,
                "queued": depth[team.pk, Job.Status.QUEUED],
                "running": depth[team.pk, Job.Status.RUNNING],
                "in_use": slots.team[team.pk],
                "cap": caps.team.get(team.pk),
                "weight": record.weight(team.slug),
                "target_share": round(weights.get(team.pk, 0) / total_weight, 4)
                if team.pk in active and weights.get(team.pk, 0) > 0 else 0.0,
                "actual_share": round(used[team.pk] / total_used, 4) if total_used else 0.0,
                "not_served": not_served(team, head=heads.get(team.pk), usable_models=usable.get(team.pk, set()),
                                         caps=caps, slots=slots, out_of_budget=team.pk in out_of_budget),
            }
            for team in teams
        ],
        "users": [
            {"user": usernames[uid], "in_use": slots.user[uid], "cap": caps.user.get(uid)}
            for uid in sorted(usernames, key=usernames.get)
        ],
        "executors": [
            {
                "name": e.name,
                "kind": e.kind,
                "team": e.team.slug if e.team else None,
                "enabled": e.enabled,
                "health": e.health,
                "breaker": e.breaker,
                "models": e.offered_models,
                "in_use": slots.executor[e.pk],
                "limit": executor_limit(name=e.name, max_concurrency=e.max_concurrency, caps=caps),
            }
            for e in executors
        ],
    }


def slot_seconds(*, since, now) -> Counter:
    """Slot-seconds each team held since `since`: attempts that ended in the window, and running ones."""
    start = Greatest(F("started_at"), Value(since))
    ended = Job.objects.filter(finished_at__gte=since, started_at__isnull=False)
    running = Job.objects.filter(status=Job.Status.RUNNING)
    totals: Counter = Counter()
    for query, end in ((ended, F("finished_at")), (running, Value(now))):
        span = ExpressionWrapper(end - start, output_field=DurationField())
        for team_id, held in query.order_by().values_list("team_id").annotate(held=Coalesce(Sum(span), timedelta(0))):
            totals[team_id] += held.total_seconds()
    return totals


def queue_heads(team_ids: list[int]) -> dict[int, tuple[str, int]]:
    """The (model, user id) of each team's next queued job by priority, then readiness: one query with
    a lookup per team on its queue index. Tool jobs need no executor, so they never wait for one."""
    if not team_ids:
        return {}
    head = (Job.objects.filter(team=OuterRef("pk"), status=Job.Status.QUEUED).exclude(type=Job.Type.TOOL)
            .order_by("-priority", "ready_at", "id"))
    rows = Team.objects.filter(pk__in=team_ids).annotate(
        head_model=Subquery(head.values("model")[:1]), head_user=Subquery(head.values("user_id")[:1]),
    ).values_list("pk", "head_model", "head_user")
    return {team_id: (model, user_id) for team_id, model, user_id in rows if model is not None}


def not_served(team: Team, *, head: tuple[str, int] | None, usable_models: set[str], caps, slots,
               out_of_budget: bool) -> list[str]:
    """Why a team with queued work (its next job is `head`: model, user id) is not getting more
    of it started."""
    if head is None:
        return []
    model, user_id = head
    reasons = []
    if team.pk in caps.team and slots.team[team.pk] >= caps.team[team.pk]:
        reasons.append("at team cap")
    if out_of_budget:
        reasons.append("over budget")
    if user_id in caps.user and slots.user[user_id] >= caps.user[user_id]:
        reasons.append("at user cap")
    if model not in usable_models:
        reasons.append("no executor offers the model")
    if caps.global_cap is not None and slots.total >= caps.global_cap:
        reasons.append("at global cap")
    return reasons


RECENT_JOBS = 25


def dashboard_state(*, user: rbac.Principal) -> dict[str, Any]:
    """What the live dashboard shows: the queue snapshot, and the latest jobs the user may see."""
    jobs = rbac.visible_jobs(user).select_related("team", "user", "executor").defer("input", "result", "conversation")
    return {
        "queue": queue_snapshot(user=user),
        "jobs": [
            {
                "id": job.pk, "team": job.team.slug, "user": job.user.get_username(), "type": job.type,
                "model": job.model, "priority": job.priority, "status": job.status,
                "round": job.current_round, "round_label": job.round_label,
                "executor": job.executor.name if job.executor else None, "attempts": job.attempts,
                "tokens_used": job.tokens_used, "submitted_at": job.submitted_at, "started_at": job.started_at,
                "finished_at": job.finished_at, "error": job.error[:200],
            }
            for job in jobs.order_by("-id")[:RECENT_JOBS]
        ],
    }
