"""Concurrency governance at four scopes (global, executor, team, user).

Caps come from `QuotaPolicy(dimension=ai.concurrency)` (and an executor's own max_concurrency);
in-use counts come from live Slot rows, never from counters, so they cannot drift: a crashed
worker's slots are counted until recovery deletes them, and never after."""

from collections import Counter
from dataclasses import dataclass, field

from django.contrib.auth import get_user_model
from django.db.models import Count, OuterRef, Subquery

from quotas.models import QuotaPolicy
from scheduler.models import Slot
from telemachus.models import Team


@dataclass(frozen=True)
class ConcurrencyCaps:
    """Slot caps per scope; a scope without a rule is uncapped (absent / None)."""

    global_cap: int | None = None
    executor: dict[str, int] = field(default_factory=dict)  # by executor name
    team: dict[int, int] = field(default_factory=dict)  # by team id
    user: dict[int, int] = field(default_factory=dict)  # by user id


@dataclass(frozen=True)
class SlotCounts:
    total: int = 0
    executor: Counter = field(default_factory=Counter)  # by executor id
    team: Counter = field(default_factory=Counter)
    user: Counter = field(default_factory=Counter)


def concurrency_caps() -> ConcurrencyCaps:
    """All ai.concurrency rules in one query, with team and user subjects resolved to ids."""
    users = get_user_model().objects.filter(username=OuterRef("subject")).values("pk")[:1]
    teams = Team.objects.filter(slug=OuterRef("subject")).values("pk")[:1]
    rows = (
        QuotaPolicy.objects.filter(dimension=QuotaPolicy.Dimension.CONCURRENCY)
        .annotate(team_id=Subquery(teams), user_id=Subquery(users))
        .values_list("scope", "subject", "limit", "team_id", "user_id")
    )
    global_cap, executor, team, user = None, {}, {}, {}
    for scope, subject, limit, team_id, user_id in rows:
        if scope == QuotaPolicy.Scope.GLOBAL:
            global_cap = limit
        elif scope == QuotaPolicy.Scope.EXECUTOR:
            executor[subject] = limit
        elif scope == QuotaPolicy.Scope.TEAM and team_id is not None:
            team[team_id] = limit
        elif scope == QuotaPolicy.Scope.USER and user_id is not None:
            user[user_id] = limit
    return ConcurrencyCaps(global_cap=global_cap, executor=executor, team=team, user=user)


def slot_counts() -> SlotCounts:
    """Slots held right now, per scope, from one grouped query over the Slot table."""
    counts = SlotCounts()
    grouped = Slot.objects.order_by().values_list("executor_id", "team_id", "user_id").annotate(n=Count("id"))
    total = 0
    for executor_id, team_id, user_id, n in grouped:
        counts.executor[executor_id] += n
        counts.team[team_id] += n
        counts.user[user_id] += n
        total += n
    return SlotCounts(total=total, executor=counts.executor, team=counts.team, user=counts.user)


def executor_limit(*, name: str, max_concurrency: int, caps: ConcurrencyCaps) -> int:
    """An executor's slot count: its own max_concurrency, lowered by an executor-scope rule."""
    return min(max_concurrency, caps.executor.get(name, max_concurrency))
