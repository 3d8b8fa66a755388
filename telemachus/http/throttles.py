"""Per-user request rates at every entry that creates work or holds a connection:

  TELEMACHUS_SUBMIT_RATE   job submissions (POST /api/jobs/, and each job of POST /api/jobs/bulk/)
  TELEMACHUS_OPENAI_RATE   calls to /v1/ (scheduler/gateway/caller.py)
  TELEMACHUS_STREAM_RATE   opens of GET /api/jobs/{id}/wait/ and /stream/ (scheduler/gateway/jobwatch.py)

A rate is "N/s", "N/min", "N/hour" or "N/day"; empty turns it off. Over it: 429 with Retry-After,
in the surface's error shape (`throttled` under /api/, OpenAI's `rate_limit_exceeded` under /v1/).
Counts live in Django's cache (shared through Redis when REDIS_URL is set), per user (per address
for anonymous callers, who are refused anyway).

The rate is a cell rate (GCRA): each unit of work moves the caller's "paid until" time on by
period / N, and a request is let in while that time is less than one period ahead (N units may
come in a burst, then one every period / N). A request that costs several units (a bulk submit
costs one per job) is let in whenever the caller owes less than that, and may leave them owing
more than a period: 1,000 jobs in one call at 100/s are accepted when nothing is owed, and the
caller's next submit waits the ten seconds they cost. A batch is never refused for being larger
than the rate, only ever made to wait for."""

import math
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import cache
from rest_framework.request import Request
from rest_framework.throttling import BaseThrottle
from rest_framework.views import APIView

PERIODS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
PREFIX = "telemachus:rate"


@dataclass(frozen=True)
class Rate:
    count: int
    seconds: float

    @property
    def interval(self) -> float:
        return self.seconds / self.count


def rate_parse(text: str | None) -> Rate | None:
    """ "100/s", "600/min", "N/hour", "N/day" (DRF's notation: the period's first letter counts);
    None for empty (off). Raises ValueError for anything else."""
    if not text:
        return None
    count, _, period = text.partition("/")
    if not count.strip().isdigit() or int(count) < 1 or period.strip()[:1].lower() not in PERIODS:
        raise ValueError(f"A rate is N/s, N/min, N/hour or N/day (N at least 1), not {text!r}.")
    return Rate(int(count), PERIODS[period.strip()[0].lower()])


def rate_take(*, scope: str, ident: str, rate: Rate, cost: int = 1, now: float | None = None) -> int | None:
    """Count `cost` units of work against the caller's rate: None when let in, else the whole
    seconds to wait (nothing is counted then). Like DRF's throttles, a read and a write of the
    cache: two requests at the same instant may both get the last unit."""
    now = time.time() if now is None else now
    key = f"{PREFIX}:{scope}:{ident}"
    paid_until = max(float(cache.get(key) or 0.0), now)
    owed = paid_until - now
    allowance = rate.seconds - rate.interval  # one period's worth, less the unit being asked for
    if owed > allowance:
        return max(1, math.ceil(owed - allowance))
    paid_until += max(cost, 1) * rate.interval
    cache.set(key, paid_until, timeout=math.ceil(paid_until - now) + 1)
    return None


def caller_ident(user: Any, address: str | None) -> str:
    """Whose rate a request counts against: the signed-in user's, else its address's."""
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}"
    return f"addr:{address or 'unknown'}"


class SubmitRateThrottle(BaseThrottle):
    """Job submissions per user at TELEMACHUS_SUBMIT_RATE. Only POSTs count (reading lists and jobs
    is never throttled); a view's `submit_cost(request)` says how many jobs a POST submits (the
    bulk submit: one per job), else it is one. Over the rate: 429 `throttled` with Retry-After."""

    scope = "submit"

    def __init__(self) -> None:
        self._wait: int | None = None

    def allow_request(self, request: Request, view: APIView) -> bool:
        rate = rate_parse(settings.TELEMACHUS_SUBMIT_RATE)
        if request.method != "POST" or rate is None:
            return True
        cost = view.submit_cost(request) if hasattr(view, "submit_cost") else 1
        self._wait = rate_take(
            scope=self.scope, ident=caller_ident(request.user, self.get_ident(request)), rate=rate, cost=cost
        )
        return self._wait is None

    def wait(self) -> float | None:
        return self._wait
