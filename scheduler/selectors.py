"""Reads for the API and dashboard. Writes live in scheduler/services/."""

from collections import Counter
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Count, Q

from executors.models import Executor
from quotas.concurrency import concurrency_caps, executor_limit, slot_counts
from scheduler.models import Job, QueuePolicy
from telemachus import rbac


def queue_snapshot(*, user: rbac.Principal) -> dict[str, Any]:
    """Depth per team, slots in use per scope against its cap, executors with capacity and health.
    Operators see everything; others see their own teams, themselves, and the executors their
    teams may use."""
    caps = concurrency_caps()
    slots = slot_counts()
    operator = rbac.is_operator(user)
    teams = list(rbac.visible_teams(user).order_by("slug"))
    team_ids = [t.pk for t in teams]
    depth: Counter = Counter()
    for team_id, status, n in (
        Job.objects.filter(team_id__in=team_ids, status__in=[Job.Status.QUEUED, Job.Status.RUNNING])
        .order_by()
        .values_list("team_id", "status")
        .annotate(n=Count("id"))
    ):
        depth[team_id, status] = n

    executors = Executor.objects.select_related("team").order_by("name")
    if not operator:
        executors = executors.filter(team__isnull=True) | executors.filter(team_id__in=team_ids)
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
                "models": e.offered_models,
                "in_use": slots.executor[e.pk],
                "limit": executor_limit(name=e.name, max_concurrency=e.max_concurrency, caps=caps),
            }
            for e in executors
        ],
    }



def queue_policy() -> QueuePolicy:
    """The policy record as it is now, without locking it (the claim reads it under its lock)."""
    return QueuePolicy.objects.filter(pk=QueuePolicy.SINGLETON_ID).first() or QueuePolicy()


def queued_heads(
    *, wanted: dict[int, tuple[set[str], int]], exclude_users: set[int], now: datetime
) -> dict[int, list[Job]]:
    """The head of each team's line: for each team id in `wanted`, up to n of its queued jobs for
    the given models, highest priority then oldest first, skipping users at their cap and retries
    still waiting out their backoff.

    One indexed lookup per team (job_team_queue_idx), so rows examined grow with the number of
    teams and the batch size, not with the depth of any queue. On PostgreSQL the lookups travel
    as one UNION ALL; SQLite cannot slice inside a compound query, and its queries are in-process
    calls, so it runs them one by one."""
    queries = []
    for team_id, (models, n) in wanted.items():
        if not models or n <= 0:
            continue
        query = Job.objects.filter(
            Q(run_after__isnull=True) | Q(run_after__lte=now),
            team_id=team_id, status=Job.Status.QUEUED, model__in=sorted(models),
        )
        if exclude_users:
            query = query.exclude(user_id__in=exclude_users)
        queries.append(query.order_by("-priority", "id")[:n])
    heads: dict[int, list[Job]] = {}
    if not queries:
        return heads
    if connection.features.supports_slicing_ordering_in_compound:
        rows = list(queries[0].union(*queries[1:], all=True)) if len(queries) > 1 else list(queries[0])
    else:
        rows = [job for query in queries for job in query]
    for job in rows:
        heads.setdefault(job.team_id, []).append(job)
    for jobs in heads.values():
        jobs.sort(key=lambda job: (-job.priority, job.pk))
    return heads
