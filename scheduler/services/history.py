"""The dashboard's history: one `QueueSample` row per bucket (a minute by default) per team, per
executor and for the whole queue, written by the workers and pruned past its retention.

Why the workers write it, and not the page or a computation over stored jobs: queue depth,
running jobs and slots in use are gauges, and past values of a gauge cannot be rebuilt from the
jobs table (requeues, retries, a flow between rounds, deleted slot leases leave no trace there),
so someone must look at them as time passes; the workers always run, open dashboards may not. What
happened within a bucket (jobs started and finished, tokens, queue waits) could be computed from
the jobs' timestamps at read time, but then every chart refresh would scan a day of jobs; it is
counted once here, through the events index, when the bucket closes.

A gauge's row holds the most it was at once within the bucket, not its value as the bucket closed:
a burst that comes and drains within a minute is what an operator needs to see, and a reading at
the close alone drew it as nothing (and a burst that outlived the close as a ramp across the whole
minute). Each worker reads the gauges every TELEMACHUS_HISTORY_SAMPLE_SECONDS (2 s) and keeps each
one's highest in memory until the bucket closes (`HistoryRecorder`): three small reads (the queue
tally, running jobs grouped by team, slots grouped by scope) on the worker's database thread
between claims, nothing on the claim's or the finish's way. A burst shorter than the sample
interval can still fall between two reads; jobs started and ended in it are counted all the same.
Why not finer buckets for the last hour instead: they would still be readings at instants (a finer
grid of the same blind spots), multiply the rows written and read, and a range of 6 or 24 hours
folds them back into steps whose highest value is what the peak per bucket gives already.

Any number of workers call `history_record` as each bucket closes; the first insert wins (unique
per bucket and subject) and the others are ignored, so the table holds at most
retention / bucket x (teams + executors + 1) rows. A worker that has not watched the whole bucket
(it started within it) leaves the first go to one that has, and writes the bucket only if it is
still missing a sample interval later; a bucket that no worker saw at all is not written (the
charts show the gap)."""

import math
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from statistics import quantiles
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from executors.models import Executor
from quotas.concurrency import SlotCounts, concurrency_caps, executor_limit
from scheduler.core.selectors import jobs_running, queue_depths, slot_counts
from scheduler.models import Job, JobEvent, QueueSample

ENDED: dict[str, str] = {
    JobEvent.Type.FINISHED: "finished",
    JobEvent.Type.FAILED: "failed",
    JobEvent.Type.CANCELED: "canceled",
}
# How long after a bucket closes it is recorded, so the bucket's last commits land.
CLOSE_DELAY = 0.2


def _sums() -> dict[str, str]:
    """Per-job amounts added up per bucket when jobs end: tokens, and money (`Job.cost`, a Decimal
    per job, summed here as a float for the charts: docs/keys.md). The dashboard draws a "cost"
    chart as soon as buckets hold some (scheduler/static/scheduler/charts.js)."""
    return {"tokens": "tokens_used", "cost": "cost"}


def bucket_seconds() -> int:
    return int(settings.TELEMACHUS_HISTORY_BUCKET_SECONDS)


def sample_seconds() -> float:
    """How often a worker reads the gauges: the setting, at most once per bucket."""
    return min(float(settings.TELEMACHUS_HISTORY_SAMPLE_SECONDS), float(bucket_seconds()))


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


def first_start_waits(*, start: datetime, end: datetime) -> dict[int, list[float]]:
    """Each team's queue waits (submitted to first started, in seconds) of the jobs that first
    started in [start, end), found through the events index. A bucket's waits when it closes, and
    the open bucket's so far for the dashboard's live tile (scheduler/live/snapshot.py), so the
    two are the same measure."""
    first_starts = Job.objects.filter(
        pk__in=JobEvent.objects.filter(event=JobEvent.Type.STARTED, at__gte=start, at__lt=end).values("job_id"),
        started_at__gte=start,
        started_at__lt=end,
    ).values_list("team_id", "submitted_at", "started_at")
    waits: dict[int, list[float]] = defaultdict(list)
    for team_id, submitted, started in first_starts:
        if started is not None:  # the filter says so; the column may be null
            waits[team_id].append(max((started - submitted).total_seconds(), 0.0))
    return waits


def waits_summary(waits: list[float]) -> dict[str, Any]:
    """How many jobs started, and their waits' p50 and p95 (None when none started)."""
    return {"started": len(waits), "wait_p50": _percentile(waits, 50), "wait_p95": _percentile(waits, 95)}


@dataclass(frozen=True)
class GaugeReading:
    """The gauges at one moment: each team's queued and running jobs, and the slots in use."""

    queued: dict[int, int]
    running: dict[int, int]
    slots: SlotCounts

    @classmethod
    def read(cls) -> "GaugeReading":
        """Three small reads: the queue tally, running jobs grouped by team, slots grouped by scope."""
        return cls(queued=queue_depths(), running=jobs_running(), slots=slot_counts())


@dataclass
class BucketPeaks:
    """The most each gauge was at once, as far as this process's readings saw, within one bucket:
    per team, per executor and for the whole queue (whose peak is of the sum at one moment, not a
    sum of the teams' peaks). `first_at` is when this process first read the gauges in it."""

    first_at: datetime
    teams: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    executors: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    whole: dict[str, int] = field(default_factory=lambda: {"queued": 0, "running": 0, "in_use": 0})

    def add(self, reading: GaugeReading) -> None:
        for name, counts in (("queued", reading.queued), ("running", reading.running), ("in_use", reading.slots.team)):
            for team_id, n in counts.items():
                if n > self.teams[team_id].get(name, 0):
                    self.teams[team_id][name] = n
        at_once = {
            "queued": sum(n for n in reading.queued.values() if n > 0),
            "running": sum(reading.running.values()),
            "in_use": reading.slots.total,
        }
        for name, n in at_once.items():
            self.whole[name] = max(self.whole[name], n)
        for executor_id, n in reading.slots.executor.items():
            self.executors[executor_id] = max(self.executors[executor_id], n)


class HistoryRecorder:
    """A worker process's recorder: reads the gauges each time it is called (every sample interval,
    `next_in`), keeps their peaks per bucket, and writes each bucket as it closes. Its state is
    this process's memory only: what it read in the open bucket, and the newest bucket it knows is
    written (so the calls between closes cost the three reads and nothing else). One per process
    (`history_record`); the worker calls it on its database thread, never inside a transaction."""

    def __init__(self) -> None:
        self._peaks: dict[datetime, BucketPeaks] = {}
        self._written: datetime | None = None

    def next_in(self, *, now: datetime | None = None) -> float:
        """Seconds until the next reading: a sample interval, or the close of the current bucket
        (plus CLOSE_DELAY) when that comes first or soon after."""
        now = now or timezone.now()
        close = (bucket_start(now) + timedelta(seconds=bucket_seconds()) - now).total_seconds() + CLOSE_DELAY
        every = sample_seconds()
        return close if close < every * 1.5 else every

    def record(self, *, now: datetime | None = None) -> datetime | None:
        """Read the gauges into the open bucket's peaks; then write the bucket that closed last
        (before `now`) with its peaks and what happened in it, unless a worker has written it
        already, and delete buckets older than the retention. Returns the bucket's start, or None
        when it wrote nothing. Reads outside any transaction (a reading need not be one snapshot);
        writes in one short transaction of its own, locking no rows."""
        now = now or timezone.now()
        size = timedelta(seconds=bucket_seconds())
        current = bucket_start(now)
        start = current - size
        reading = GaugeReading.read()
        self._peaks.setdefault(current, BucketPeaks(first_at=now)).add(reading)
        for older in [at for at in self._peaks if at < start]:
            del self._peaks[older]
        if self._written is not None and self._written >= start:
            return None
        peaks = self._peaks.get(start)
        if peaks is None:
            return None  # this process was not running then: a bucket no worker saw stays a gap
        watched = peaks.first_at - start <= timedelta(seconds=sample_seconds() + 2 * CLOSE_DELAY)
        if not watched and now - current < timedelta(seconds=sample_seconds()):
            return None  # a worker that read the gauges all through the bucket writes it first
        if QueueSample.objects.filter(at=start, team=None, executor=None).exists():
            self._written = start
            return None
        peaks.add(reading)  # the gauges as the bucket closed, as near as this process read them
        rows = _bucket_rows(start=start, end=current, peaks=peaks)
        retention = timedelta(hours=settings.TELEMACHUS_HISTORY_RETENTION_HOURS)
        with transaction.atomic(durable=True):
            QueueSample.objects.bulk_create(rows, ignore_conflicts=True)
            QueueSample.objects.filter(at__lt=now - retention).delete()
        self._written = start
        return start


def _bucket_rows(*, start: datetime, end: datetime, peaks: BucketPeaks) -> list[QueueSample]:
    """The bucket's rows: each gauge's peak, caps as they stand, and what happened in [start, end)."""
    teams: dict[int, dict[str, Any]] = defaultdict(dict)
    for team_id, gauges in peaks.teams.items():
        teams[team_id].update({name: n for name, n in gauges.items() if n})
    whole: dict[str, Any] = dict(peaks.whole)
    caps = concurrency_caps()
    for team_id, cap in caps.team.items():
        if teams.get(team_id):  # an idle team's cap alone is not worth a row
            teams[team_id]["cap"] = cap
    whole["cap"] = caps.global_cap

    # What happened in the bucket, found through the (event, at) index rather than a scan of jobs,
    # and added up per team by the database: a busy minute ends tens of thousands of jobs, more
    # than one statement may name one by one (PostgreSQL takes 65,535 parameters; SQLite builds
    # take 32,766 or 250,000).
    # A job ends once, so each ended event is one job.
    sums = _sums()
    ended = (
        JobEvent.objects.filter(event__in=list(ENDED), at__gte=start, at__lt=end)
        .order_by()
        .values_list("job__team_id", "event")
        .annotate(Count("pk"), *(Sum(f"job__{column}") for column in sums.values()))
    )
    for team_id, event, n, *amounts in ended:
        for row in (teams[team_id], whole):
            row[ENDED[event]] = row.get(ENDED[event], 0) + n
            for name, amount in zip(sums, amounts, strict=True):
                row[name] = row.get(name, 0) + float(amount or 0)
    waits = first_start_waits(start=start, end=end)
    for team_id, seen in waits.items():
        teams[team_id].update(waits_summary(seen))
    whole.update(waits_summary([w for team_waits in waits.values() for w in team_waits]))

    rows = [QueueSample(at=start, values=whole)]
    rows += [QueueSample(at=start, team_id=team_id, values=values) for team_id, values in teams.items() if values]
    for executor in Executor.objects.only("pk", "name", "max_concurrency", "enabled", "health"):
        limit = executor_limit(name=executor.name, max_concurrency=executor.max_concurrency, caps=caps)
        rows.append(
            QueueSample(
                at=start,
                executor_id=executor.pk,
                values={
                    "in_use": peaks.executors.get(executor.pk, 0),
                    "limit": limit,
                    "enabled": executor.enabled,
                    "health": executor.health,
                },
            )
        )
    return rows


# The worker's recorder: one per process, called from its database thread only.
_recorder = HistoryRecorder()


def history_record(*, now: datetime | None = None) -> datetime | None:
    """This process's recorder (HistoryRecorder.record): read the gauges, write a closed bucket."""
    return _recorder.record(now=now)


def history_next_in(*, now: datetime | None = None) -> float:
    """Seconds until this process should call `history_record` again (HistoryRecorder.next_in)."""
    return _recorder.next_in(now=now)
