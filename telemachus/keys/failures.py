"""Failed authentication: counted and answered 429, never in the way of a right credential.

Every request's key or token is looked up first (telemachus/keys/authentication.py). One that
matches a live key or token authenticates, whatever failed before it from its address or with its
prefix: an attacker's failures, or a misconfigured app's behind the same proxy or NAT, lock out
nobody. Only an attempt that matches nothing is counted, over a window that starts at its
counter's first failure (TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS), twice:

* per client address: past TELEMACHUS_AUTH_FAILURES_PER_ADDRESS failed attempts, that address's
  further failed attempts are answered 429 with Retry-After (until the window ends) instead of 401;
* per credential presented, by its prefix (the marker and the first five random characters, what a
  key list shows; a digest of it is what is counted), from any address: past
  TELEMACHUS_AUTH_FAILURES_PER_CREDENTIAL, failed attempts with that prefix are answered 429 too,
  so guessing at one known key from many addresses is answered as from one.

An address crossing its limit is logged once per window (`telemachus.auth`), for a proxy's or
fail2ban's ban, which can drop a flood before it costs a lookup; this module cannot, without
refusing the right credentials that share the address.

What a guesser gets: each attempt costs one HTTP request and one indexed lookup, the cheapest
request there is; past the limits it is answered 429, and a right guess would still authenticate
(the price of never locking out a right credential). The odds, not the rate, keep guessing
hopeless: a secret is 192 random bits, 162 of them unknown to someone who knows a key's displayed
prefix, so at a million attempts a second the expected wait is about 10^35 years. Nothing secret
is compared in Python: the lookup is an equality on the keyed digest (HMAC-SHA256 under
SECRET_KEY) in the database's index, and its time depends on that digest, which a guesser cannot
steer without SECRET_KEY (telemachus/keys/digests.py).

Counts live in Django's cache, as the sign-in counts do (telemachus/teams/signin.py): per process
by default, shared by every API server through Redis when REDIS_URL is set."""

import hashlib
import logging
import math
import time

from django.conf import settings
from django.core.cache import cache

from telemachus.keys.digests import secret_prefix

PREFIX = "telemachus:authfail"
log = logging.getLogger("telemachus.auth")


def _keys(kind: str, value: str) -> tuple[str, str]:
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{PREFIX}:{kind}:{digest}:count", f"{PREFIX}:{kind}:{digest}:since"


def _count(count_key: str, since_key: str, window: int) -> int:
    """One more failure on a counter (atomic increments); its count now."""
    cache.add(since_key, time.time(), timeout=window)
    cache.add(count_key, 0, timeout=window)
    try:
        return int(cache.incr(count_key))
    except ValueError:  # expired between add and incr: a new window
        cache.set(count_key, 1, timeout=window)
        return 1


def auth_failure_record(*, address: str, secret: str) -> int | None:
    """Count one failed attempt (a secret that matched no live key or token) against its address
    and its prefix. Returns the seconds until the window of a counter over its limit ends (the
    attempt is then answered 429 with that Retry-After), or None (answered 401)."""
    window = settings.TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS
    counters = [
        ("addr", address, settings.TELEMACHUS_AUTH_FAILURES_PER_ADDRESS),
        ("cred", secret_prefix(secret), settings.TELEMACHUS_AUTH_FAILURES_PER_CREDENTIAL),
    ]
    over = []
    for kind, value, limit in counters:
        count_key, since_key = _keys(kind, value)
        count = _count(count_key, since_key, window)
        if 0 < limit < count:
            over.append(since_key)
            if kind == "addr" and count == limit + 1:
                log.warning("authentication failures: %s is over its limit of %d in %d s", address, limit, window)
    if not over:
        return None
    now = time.time()
    since = cache.get_many(over)
    return max(max(math.ceil(since.get(key, now) + window - now), 1) for key in over)
