"""Concurrency governance at five scopes (global, executor, team, user, API key).

Caps come from `QuotaPolicy(dimension=ai.concurrency)` (and an executor's own max_concurrency);
in-use counts come from live Slot rows, never from counters, so they cannot drift: a crashed
worker's slots are counted until recovery deletes them, and never after (the scheduler, which owns
the slots, counts them: scheduler.core.selectors.slot_counts).

An API key acts as a user of its own (telemachus/keys/), so a key's cap is a cap on that user's
slots: it is enforced as one (the lower of the two, if the user scope names the key's user too),
and `key` keeps it by key id for display."""

from collections import Counter
from dataclasses import dataclass, field

from quotas.models import QuotaPolicy
from quotas.rules import Rule, quota_rules


@dataclass(frozen=True)
class ConcurrencyCaps:
    """Slot caps per scope; a scope without a rule is uncapped (absent / None)."""

    global_cap: int | None = None
    executor: dict[str, int] = field(default_factory=dict)  # by executor name
    team: dict[int, int] = field(default_factory=dict)  # by team id
    user: dict[int, int] = field(default_factory=dict)  # by user id (a key's cap: its user's)
    key: dict[int, int] = field(default_factory=dict)  # by API key id, for display
    key_users: dict[int, int] = field(default_factory=dict)  # API key id -> the user it acts as


@dataclass(frozen=True)
class SlotCounts:
    total: int = 0
    executor: Counter[int] = field(default_factory=Counter)  # by executor id
    team: Counter[int] = field(default_factory=Counter)
    user: Counter[int] = field(default_factory=Counter)
    # Slots held by batch lines, by executor: counted against each executor's batch share.
    batch: Counter[int] = field(default_factory=Counter)


def concurrency_caps(rules: list[Rule] | None = None) -> ConcurrencyCaps:
    """The ai.concurrency rules (of `rules`, or all, loaded in one query) as slot caps per scope."""
    global_cap: int | None = None
    executor: dict[str, int] = {}
    team: dict[int, int] = {}
    user: dict[int, int] = {}
    key: dict[int, int] = {}
    key_users: dict[int, int] = {}
    for rule in quota_rules() if rules is None else rules:
        if rule.dimension != QuotaPolicy.Dimension.CONCURRENCY:
            continue
        if rule.scope == QuotaPolicy.Scope.GLOBAL:
            global_cap = rule.limit
        elif rule.scope == QuotaPolicy.Scope.EXECUTOR:
            executor[rule.subject] = rule.limit
        elif rule.scope == QuotaPolicy.Scope.TEAM and rule.subject_id is not None:
            team[rule.subject_id] = rule.limit
        elif rule.scope == QuotaPolicy.Scope.USER and rule.subject_id is not None:
            user[rule.subject_id] = min(rule.limit, user.get(rule.subject_id, rule.limit))
        elif rule.scope == QuotaPolicy.Scope.KEY and rule.subject_id is not None:
            key[int(rule.subject)], key_users[int(rule.subject)] = rule.limit, rule.subject_id
            user[rule.subject_id] = min(rule.limit, user.get(rule.subject_id, rule.limit))
    return ConcurrencyCaps(global_cap=global_cap, executor=executor, team=team, user=user, key=key, key_users=key_users)


def executor_limit(*, name: str, max_concurrency: int, caps: ConcurrencyCaps) -> int:
    """An executor's slot count: its own max_concurrency, lowered by an executor-scope rule."""
    return min(max_concurrency, caps.executor.get(name, max_concurrency))
