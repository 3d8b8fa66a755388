"""The `sim` executor's knobs (its `meta`), with the bounds that keep a simulated dispatch finite:
the API and the admin refuse a value outside them, naming the knob, and the driver reads a stored
one (written by SQL, or before these checks) as its default or clamped, never as a hang or a crash.

name -> (default, low, high, integer)."""

import math
from typing import Any

KNOBS: dict[str, tuple[float, float, float, bool]] = {
    "latency_ms": (50, 0, 600_000, False),  # at most 10 minutes per dispatch
    "jitter_ms": (0, 0, 600_000, False),
    "tokens_per_s": (0, 0, 1_000_000, False),  # 0: no generation time
    "output_tokens": (16, 0, 100_000, True),
    "fail_rate": (0, 0, 1, False),
    "embedding_dims": (8, 1, 4096, True),
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def knob_problems(meta: dict[str, Any]) -> dict[str, str]:
    """Each knob in `meta` that is not a number within its bounds, with what is wrong."""
    problems = {}
    for name, (_, low, high, integer) in KNOBS.items():
        if name not in meta:
            continue
        number = _number(meta[name])
        kind = "an integer" if integer else "a number"
        if number is None or (integer and not number.is_integer()) or not low <= number <= high:
            problems[name] = f"must be {kind} from {low:g} to {high:g} (got {meta[name]!r:.40})."
    return problems


def knob(meta: dict[str, Any], name: str) -> float:
    """The value of knob `name` to use: the stored one clamped into its bounds, or the default
    when it is missing or not a finite number."""
    default, low, high, integer = KNOBS[name]
    number = _number(meta.get(name, default))
    if number is None:
        return default
    number = min(max(number, low), high)
    return float(int(number)) if integer else number
