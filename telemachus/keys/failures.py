"""Failed authentication, limited per client address.

Each request whose key or token matches nothing counts against its client address, over a window
that starts at the first failure. Past TELEMACHUS_AUTH_FAILURES_PER_ADDRESS failures, every request
from that address that carries credentials is answered 429 with Retry-After until the window ends,
before its credentials are looked at: otherwise a guesser would still learn which guess is right.
Counts live in Django's cache, as the sign-in counts do (telemachus/teams/signin.py): per process
by default, shared by every API server through Redis when REDIS_URL is set."""

import hashlib
import math
import time

from django.conf import settings
from django.core.cache import cache

PREFIX = "telemachus:authfail"


def _keys(address: str) -> tuple[str, str]:
    digest = hashlib.sha256(address.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{PREFIX}:{digest}:count", f"{PREFIX}:{digest}:since"


def auth_retry_after(*, address: str) -> int | None:
    """Seconds until this address may present credentials again, or None when it may now."""
    limit = settings.TELEMACHUS_AUTH_FAILURES_PER_ADDRESS
    if limit <= 0:
        return None
    count_key, since_key = _keys(address)
    found = cache.get_many([count_key, since_key])
    remaining = found.get(since_key, time.time()) + settings.TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS - time.time()
    if found.get(count_key, 0) >= limit and remaining > 0:
        return max(math.ceil(remaining), 1)
    return None


def auth_failure_record(*, address: str) -> None:
    """Count one failed authentication against the address (atomic increments)."""
    window = settings.TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS
    count_key, since_key = _keys(address)
    cache.add(since_key, time.time(), timeout=window)
    cache.add(count_key, 0, timeout=window)
    try:
        cache.incr(count_key)
    except ValueError:  # expired between add and incr: a new window
        cache.set(count_key, 1, timeout=window)
