"""Reads that the claim and the services share. Writes live in scheduler/services/."""

from datetime import datetime

from django.db import connection
from django.db.models import Q

from scheduler.models import Job, QueuePolicy


def queue_policy() -> QueuePolicy:
    """The policy record as it is now, without locking it (the claim reads it under its lock)."""
    return QueuePolicy.objects.filter(pk=QueuePolicy.SINGLETON_ID).first() or QueuePolicy()


def queued_heads(
    *, wanted: dict[int, tuple[set[str], int]], exclude_users: set[int], now: datetime, oldest_too: bool = False
) -> dict[int, list[Job]]:
    """The head of each team's line: for each team id in `wanted`, up to n of its queued jobs for
    the given models, highest priority then oldest first, skipping users at their cap and retries
    still waiting out their backoff; with `oldest_too`, also its n oldest (which aging may lift).

    Indexed lookups per team (job_team_queue_idx, job_team_age_idx), so rows examined grow with
    the number of teams and the batch size, not with the depth of any queue. On PostgreSQL the
    lookups travel as one UNION ALL; SQLite cannot slice inside a compound query, and its queries
    are in-process calls, so it runs them one by one. Each team's jobs come back unsorted."""
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
        if oldest_too:
            queries.append(query.order_by("id")[:n])
    heads: dict[int, list[Job]] = {}
    if not queries:
        return heads
    if connection.features.supports_slicing_ordering_in_compound:
        rows = list(queries[0].union(*queries[1:], all=True)) if len(queries) > 1 else list(queries[0])
    else:
        rows = [job for query in queries for job in query]
    seen = set()
    for job in rows:
        if job.pk not in seen:
            seen.add(job.pk)
            heads.setdefault(job.team_id, []).append(job)
    return heads
