"""The dashboard's history: one `QueueSample` row per bucket (a minute by default) per team, per
executor and for the whole queue, written by the workers and pruned past its retention.

Why the workers write it, and not the page or a computation over stored jobs: queue depth,
running jobs and slots in use are gauges, and past values of a gauge cannot be rebuilt from the
jobs table (requeues, retries, a flow between rounds, deleted slot leases leave no trace there),
so someone must look at them as time passes; the workers always run, open dashboards may not. What
happened within a bucket (jobs started and finished, tokens, queue waits) could be computed from
the jobs' timestamps at read time, but then every chart refresh would scan a day of jobs; it is
counted once here, through the events index, when the bucket closes.

Any number of workers call `history_record` as each bucket closes; the first insert wins (unique
per bucket and subject) and the others are ignored, so the table holds at most
retention / bucket x (teams + executors + 1) rows."""

import math
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from statistics import quantiles
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from executors.models import Executor
from quotas.concurrency import concurrency_caps, executor_limit
from scheduler.core.selectors import slot_counts
from scheduler.models import Job, JobEvent, QueueSample

ENDED: dict[str, str] = {
    JobEvent.Type.FINISHED: "finished",
    JobEvent.Type.FAILED: "failed",
    JobEvent.Type.CANCELED: "canceled",
}


def _sums() -> dict[str, str]:
    """Per-job amounts added up per bucket when jobs end: tokens, and money (`Job.cost`, a Decimal
    per job, summed here as a float for the charts: docs/keys.md). The dashboard draws a "cost"
    chart as soon as buckets hold some (scheduler/static/scheduler/charts.js)."""
    return {"tokens": "tokens_used", "cost": "cost"}


def bucket_seconds() -> int:
    return int(settings.TELEMACHUS_HISTORY_BUCKET_SECONDS)


def bucket_start(moment: datetime) -> datetime:
    """The start of the bucket `moment` falls in (buckets are aligned on the epoch, in UTC)."""
    size = bucket_seconds()
    return datetime.fromtimestamp(math.floor(moment.timestamp() / size) * size, tz=UTC)


def _percentile(waits: list[float], q: int) -> float | None:
    if not waits:
        return None
    if len(waits) == 1:
        return round(waits[0], 3)
    return round(quantiles(waits, n=100, method="inclusive")[q - 1], 3)


def history_record(*, now: datetime | None = None) -> datetime | None:
    """Write the bucket that closed last (before `now`), unless a worker has written it already, and
    delete buckets older than the retention. Returns the bucket's start, or None when there was
    nothing to do. Reads outside any transaction (a sample need not be one snapshot); writes in
    one short transaction of its own, locking no rows: call it outside a transaction."""
    now = now or timezone.now()
    size = timedelta(seconds=bucket_seconds())
    start = bucket_start(now) - size
    end = start + size
    if QueueSample.objects.filter(at=start, team=None, executor=None).exists():
        return None

    teams: dict[int, dict[str, Any]] = defaultdict(dict)
    whole: dict[str, Any] = {"queued": 0, "running": 0}
    for team_id, status, n in (
        Job.objects.filter(status__in=[Job.Status.QUEUED, Job.Status.RUNNING])
        .order_by()
        .values_list("team_id", "status")
        .annotate(n=Count("id"))
    ):
        teams[team_id][status] = n
        whole[status] += n

    slots, caps = slot_counts(), concurrency_caps()
    for team_id, n in slots.team.items():
        teams[team_id]["in_use"] = n
    for team_id, cap in caps.team.items():
        if team_id in teams:  # an idle team's cap alone is not worth a row
            teams[team_id]["cap"] = cap
    whole.update(in_use=slots.total, cap=caps.global_cap)

    # What happened in the bucket, found through the (event, at) index rather than a scan of jobs.
    sums = _sums()
    ended = (
        JobEvent.objects.filter(event__in=list(ENDED), at__gte=start, at__lt=end)
        .order_by()
        .values_list("job_id", "event")
    )
    how = dict(ended)
    for team_id, job_id, *amounts in Job.objects.filter(pk__in=list(how)).values_list("team_id", "pk", *sums.values()):
        for row in (teams[team_id], whole):
            row[ENDED[how[job_id]]] = row.get(ENDED[how[job_id]], 0) + 1
            for name, amount in zip(sums, amounts, strict=True):
                row[name] = row.get(name, 0) + float(amount or 0)
    first_starts = Job.objects.filter(
        pk__in=JobEvent.objects.filter(event=JobEvent.Type.STARTED, at__gte=start, at__lt=end).values("job_id"),
        started_at__gte=start,
        started_at__lt=end,
    ).values_list("team_id", "submitted_at", "started_at")
    waits: dict[int, list[float]] = defaultdict(list)
    for team_id, submitted, started in first_starts:
        if started is not None:  # the filter says so; the column may be null
            waits[team_id].append(max((started - submitted).total_seconds(), 0.0))
    for team_id, seen in [*waits.items(), (None, [w for team_waits in waits.values() for w in team_waits])]:
        row = whole if team_id is None else teams[team_id]
        row.update(started=len(seen), wait_p50=_percentile(seen, 50), wait_p95=_percentile(seen, 95))

    rows = [QueueSample(at=start, values=whole)]
    rows += [QueueSample(at=start, team_id=team_id, values=values) for team_id, values in teams.items() if values]
    for executor in Executor.objects.only("pk", "name", "max_concurrency", "enabled", "health"):
        limit = executor_limit(name=executor.name, max_concurrency=executor.max_concurrency, caps=caps)
        rows.append(
            QueueSample(
                at=start,
                executor_id=executor.pk,
                values={
                    "in_use": slots.executor[executor.pk],
                    "limit": limit,
                    "enabled": executor.enabled,
                    "health": executor.health,
                },
            )
        )
    retention = timedelta(hours=settings.TELEMACHUS_HISTORY_RETENTION_HOURS)
    with transaction.atomic(durable=True):
        QueueSample.objects.bulk_create(rows, ignore_conflicts=True)
        QueueSample.objects.filter(at__lt=now - retention).delete()
    return start


def history_next_in(*, now: datetime | None = None) -> float:
    """Seconds until the current bucket closes (plus a little, so the bucket's last commits land)."""
    now = now or timezone.now()
    size = timedelta(seconds=bucket_seconds())
    return (bucket_start(now) + size - now).total_seconds() + 0.2
