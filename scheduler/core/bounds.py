"""The bounds of the queue policy's operator settings, and the policy the scheduler runs with.

One table of bounds serves three readers: the API's input (PUT /api/policy/ answers a clear 400),
the admin's form (QueuePolicyForm), and `policy_in_force`, which the claim, the submit, the
finish, recovery and the queue snapshot read the record through. The last matters because a
stored value can still be out of bounds (written before these bounds, by SQL, by a migration):
such a value is logged once and replaced by the last good value this process saw, or the
default, so a bad setting can never crash a worker or a page (an `aging_after_seconds` of 1e11
used to overflow a datetime in every claim, and every worker exited)."""

import copy
import logging
import math
from typing import Any

from scheduler.models import Job, QueuePolicy

log = logging.getLogger("telemachus.policy")

DAY = 86_400.0
WEIGHT_MAX = 1_000_000.0
DEPTH_MAX = 10_000_000
# field: (minimum, maximum, type); the bounds are inclusive.
SCALARS: dict[str, tuple[float, float, type]] = {
    "default_weight": (0.0, WEIGHT_MAX, float),
    "half_life_seconds": (1.0, 30 * DAY, float),
    "entry_penalty": (0.0, 1_000_000.0, float),
    "aging_after_seconds": (0.0, 365 * DAY, float),
    "aging_step_seconds": (1.0, 365 * DAY, float),
    "aging_max_boost": (0, Job.PRIORITY_MAX - Job.PRIORITY_MIN, int),
    "max_attempts": (1, 100, int),
    "share_window_seconds": (1.0, 30 * DAY, float),
    "affinity_wait_ms": (0, 60_000, int),
    "batch_share": (0.0, 1.0, float),
}
# Maps from a key (team slug, "default", role, team:<slug>, user:<name>) to a bounded number.
MAPS: dict[str, tuple[float, float, type]] = {
    "team_weights": (0.0, WEIGHT_MAX, float),
    "max_queue_depth": (0, DEPTH_MAX, int),
    "priority_map": (Job.PRIORITY_MIN, Job.PRIORITY_MAX, int),
}
MAP_KEY_MAX_LENGTH = 200
MAP_MAX_ENTRIES = 10_000
CHOICES: dict[str, list[str]] = {
    "cost": QueuePolicy.Cost.values,
    "priority_over_limit": QueuePolicy.OverLimit.values,
    "placement": QueuePolicy.Placement.values,
    "recovery": QueuePolicy.Recovery.values,
    "flow_rounds": QueuePolicy.FlowRounds.values,
    "affinity": QueuePolicy.Affinity.values,
}

# The last value of each field that passed the check, in this process.
_last_good: dict[str, Any] = {}
_reported: set[tuple[str, str]] = set()


def _number_problem(value: Any, low: float, high: float, kind: type) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "is not a number"
    if kind is int and not float(value).is_integer():
        return "is not a whole number"
    if not math.isfinite(value) or not low <= value <= high:
        return f"is outside {low:g}..{high:g}"
    return None


def field_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for the policy field `name`, or None."""
    if name in SCALARS:
        return _number_problem(value, *SCALARS[name])
    if name in MAPS:
        if not isinstance(value, dict):
            return "is not an object"
        if len(value) > MAP_MAX_ENTRIES:
            return f"has more than {MAP_MAX_ENTRIES} entries"
        for key, item in value.items():
            if not isinstance(key, str) or not key or len(key) > MAP_KEY_MAX_LENGTH:
                return f"has a key that is not a name of 1 to {MAP_KEY_MAX_LENGTH} characters"
            problem = _number_problem(item, *MAPS[name])
            if problem is not None:
                return f"[{key!r}] {problem}"
        return None
    if name in CHOICES:
        return None if value in CHOICES[name] else f"is not one of {', '.join(CHOICES[name])}"
    return None


def policy_problems(record: QueuePolicy) -> dict[str, str]:
    """Every field of the record that is out of bounds, with what is wrong with it."""
    problems = {}
    for name in (*SCALARS, *MAPS, *CHOICES):
        problem = field_problem(name, getattr(record, name))
        if problem is not None:
            problems[name] = problem
    return problems


def policy_in_force(record: QueuePolicy) -> QueuePolicy:
    """The record with every out-of-bounds field replaced by its last good value in this process,
    or its default; the record itself when all is well (the common case costs a few comparisons).
    Each bad value is logged once per process, not at every claim."""
    problems = policy_problems(record)
    if not problems:
        for name in (*SCALARS, *MAPS, *CHOICES):
            _last_good[name] = getattr(record, name)
        return record
    safe = copy.copy(record)
    for name in (*SCALARS, *MAPS, *CHOICES):
        if name not in problems:
            _last_good[name] = getattr(record, name)
            continue
        fallback = _last_good[name] if name in _last_good else QueuePolicy._meta.get_field(name).get_default()  # type: ignore[union-attr]
        setattr(safe, name, fallback)
        key = (name, repr(getattr(record, name))[:200])
        if key not in _reported:
            _reported.add(key)
            log.error(
                "queue policy: stored %s %s (%r); using %r until an operator fixes it",
                name,
                problems[name],
                getattr(record, name),
                fallback,
            )
    return safe
