"""The dashboard's charts read back: the recorded buckets (scheduler/services/history.py) of the
last N minutes, as aligned columns ready to plot, for the teams and executors the user may see.

Long ranges are folded into steps of several buckets (at most MAX_POINTS per series): gauges and
waits keep the step's highest value (a burst or a slow spell must not be averaged away; a gauge's
bucket already holds the most it was at once within it), counts, tokens and money add up. A step
without any recorded bucket (no worker was running) is null, drawn as a gap, never as zero. The
series start at the first recorded step in the range. Each value stands for its whole step, from
its start to its end (`times`), and the page draws it so: as a level across the step, not a point
joined to the next by a slope."""

import math
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from executors.models import Executor
from scheduler.models import QueueSample
from scheduler.services.history import bucket_seconds, bucket_start
from telemachus.teams import rbac

MAX_POINTS = 360
# How a step folds its buckets' values; anything not named adds up (counts, tokens, cost).
HIGHEST = {"queued", "running", "in_use", "cap", "limit", "wait_p50", "wait_p95"}
# Not plotted.
SKIPPED = {"health", "enabled"}
# In a recorded bucket, a measure its row does not hold is 0 (nothing queued, nothing ended), except
# these: no job started means no wait to tell, no cap rule means no cap.
UNKNOWN_WHEN_ABSENT = {"wait_p50", "wait_p95", "cap", "limit"}
# Every visible team has these, even one that had no row at all (idle throughout).
TEAM_MEASURES = ("queued", "running", "in_use", "finished", "tokens")
GLOBAL_MEASURES = ("queued", "running", "in_use", "started", "finished", "failed", "canceled", "tokens")


def history_range_minutes() -> int:
    """The longest range worth asking for: the retention."""
    return int(settings.TELEMACHUS_HISTORY_RETENTION_HOURS * 60)


def _fold(into: dict[str, Any], values: dict[str, Any]) -> None:
    for name, value in values.items():
        if name in SKIPPED or value is None or isinstance(value, bool):
            continue
        if name not in into or into[name] is None:
            into[name] = value
        elif name in HIGHEST:
            into[name] = max(into[name], value)
        else:
            into[name] += value


def history_series(*, user: rbac.Principal, minutes: int, now: datetime | None = None) -> dict[str, Any]:
    """The last `minutes` of history as `{"since": epoch seconds of the first step's start, "times":
    [epoch seconds of each step's end, ...], "global": {measure: [...]}, "teams": {slug: {measure:
    [...]}}, "executors": {name: {measure: [...]}}, "currency": ...}`, every list as long as
    `times`; `cost` is money in TELEMACHUS_CURRENCY. A team with no row in a recorded bucket had
    nothing queued, running or ending then: its counts are 0 there, not gaps. Members see their
    own teams and the executors their teams may use; the whole-queue series are shown to everyone,
    as the global slot count is."""
    now = now or timezone.now()
    size = bucket_seconds()
    buckets = max(math.ceil(minutes * 60 / size), 1)
    per_step = max(math.ceil(buckets / MAX_POINTS), 1)
    step = size * per_step
    # Steps are aligned like buckets, so a bucket always lands in the same step; the last step may
    # still be filling (it ends at the open bucket, drawn at the last closed bucket's end).
    current = bucket_start(now)
    end = datetime.fromtimestamp(math.ceil(current.timestamp() / step) * step, tz=UTC)
    first = end - timedelta(seconds=step * math.ceil(buckets / per_step))
    count = round((end - first).total_seconds() / step)

    teams = dict(rbac.visible_teams(user).values_list("pk", "slug"))
    operator = rbac.is_operator(user)
    executors = {
        e.pk: e.name
        for e in Executor.objects.only("pk", "name", "team_id")
        if operator or e.team_id is None or e.team_id in teams
    }
    recorded: set[int] = set()
    whole: dict[int, dict[str, Any]] = defaultdict(dict)
    by_team: dict[str, dict[int, dict[str, Any]]] = {slug: defaultdict(dict) for slug in teams.values()}
    by_executor: dict[str, dict[int, dict[str, Any]]] = {name: defaultdict(dict) for name in executors.values()}
    rows = QueueSample.objects.filter(at__gte=first, at__lt=end).values_list("at", "team_id", "executor_id", "values")
    for at, team_id, executor_id, values in rows:
        index = int((at - first).total_seconds() // step)
        if team_id is not None:
            if team_id in teams:
                _fold(by_team[teams[team_id]][index], values)
        elif executor_id is not None:
            if executor_id in executors:
                _fold(by_executor[executors[executor_id]][index], values)
        else:
            recorded.add(index)
            _fold(whole[index], values)

    # Steps before the first recorded one are left out (the charts start where the history does);
    # a gap later on (no worker running then) stays, as nulls.
    begin = min(recorded, default=count)

    def columns(steps: dict[int, dict[str, Any]], always: tuple[str, ...] = ()) -> dict[str, list[Any]]:
        names = sorted({name for values in steps.values() for name in values} | set(always))
        return {
            name: [
                steps[i].get(name, None if name in UNKNOWN_WHEN_ABSENT else 0) if i in recorded else None
                for i in range(begin, count)
            ]
            for name in names
        }

    return {
        "bucket_seconds": size,
        "step_seconds": step,
        "minutes": minutes,
        "max_minutes": history_range_minutes(),
        "currency": settings.TELEMACHUS_CURRENCY,
        "since": int((first + timedelta(seconds=step * begin)).timestamp()),
        "times": [
            int(min(first + timedelta(seconds=step * (i + 1)), current).timestamp()) for i in range(begin, count)
        ],
        "global": columns(whole, GLOBAL_MEASURES),
        "teams": {slug: columns(steps, TEAM_MEASURES) for slug, steps in sorted(by_team.items())},
        "executors": {name: columns(steps) for name, steps in sorted(by_executor.items())},
    }
