"""Sign-in attempt limiting for the admin's and the dashboard's login forms.

Failed sign-ins are counted over a window that starts at the first failure, three ways:

* per username and client address: past TELEMACHUS_LOGIN_FAILURES_PER_USERNAME the form answers
  `429 Too Many Requests` with Retry-After to that address for that username, before the password
  is checked, until the window ends;
* per client address (whatever usernames it tries): past TELEMACHUS_LOGIN_FAILURES_PER_ADDRESS,
  429 to that address for every username;
* per username, from anywhere: never a refusal, which would let anyone lock a user (its owner
  included) out by failing on purpose from wherever; past TELEMACHUS_LOGIN_SLOWDOWN_AFTER failures
  each further attempt on the username is slowed, by a delay that doubles with each failure from
  TELEMACHUS_LOGIN_SLOWDOWN_SECONDS up to TELEMACHUS_LOGIN_SLOWDOWN_MAX_SECONDS, so guessing one
  password from many addresses stays slow while its owner still signs in.

A successful sign-in clears the count of its username at its address (not the username's count
from anywhere: an attacker's failures keep slowing the attacker). Counts live in Django's cache:
per process by default (one API process is the `make run` case), shared through Redis when
REDIS_URL is set, so every API server sees the same counts.

Django's `user_login_failed` and `user_logged_in` signals feed it, so any form that authenticates
with the request counts; `attempts_limited` wraps the views that must refuse or slow early. Built
here rather than with django-axes: axes requires the request in every `authenticate()` call (the
test client's `login()` has none), adds three tables and its own admin, and trusts
X-Forwarded-For by default; this needs the cache and two signals."""

import hashlib
import math
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.core.cache import cache
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse

PREFIX = "telemachus:signin"


def client_address(request: HttpRequest) -> str:
    """The client's address: the peer, or behind a TLS proxy (BEHIND_TLS_PROXY) the address the
    proxy saw, the last entry of X-Forwarded-For (the ones before it are the client's own claims)."""
    if settings.SECURE_PROXY_SSL_HEADER and (forwarded := request.META.get("HTTP_X_FORWARDED_FOR")):
        return forwarded.split(",")[-1].strip()
    return request.META.get("REMOTE_ADDR") or "unknown"


def _keys(kind: str, value: str) -> tuple[str, str]:
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{PREFIX}:{kind}:{digest}:count", f"{PREFIX}:{kind}:{digest}:since"


def _name(username: str) -> str:
    return username.strip().lower()


def _pair(username: str, address: str) -> str:
    return f"{_name(username)}\n{address}" if username and address else ""


def _limits(username: str, address: str) -> list[tuple[str, str, int]]:
    """The counts that refuse: (kind, counted value, limit)."""
    return [
        ("pair", _pair(username, address), settings.TELEMACHUS_LOGIN_FAILURES_PER_USERNAME),
        ("addr", address, settings.TELEMACHUS_LOGIN_FAILURES_PER_ADDRESS),
    ]


def _counted(username: str, address: str) -> list[tuple[str, str]]:
    """Every count a failure adds to: the refusing ones and the username's own (which slows)."""
    return [(kind, value) for kind, value, _ in _limits(username, address)] + [("user", _name(username))]


def signin_retry_after(*, username: str, address: str) -> int | None:
    """Seconds until this username may be tried again from this address, or None when it may now."""
    window = settings.TELEMACHUS_LOGIN_WINDOW_SECONDS
    waits = []
    for kind, value, limit in _limits(username, address):
        if limit <= 0 or not value:
            continue
        count_key, since_key = _keys(kind, value)
        found = cache.get_many([count_key, since_key])
        remaining = found.get(since_key, time.time()) + window - time.time()
        if found.get(count_key, 0) >= limit and remaining > 0:
            waits.append(math.ceil(remaining))
    return max(waits) if waits else None


def signin_delay(*, username: str) -> float:
    """Seconds an attempt on this username waits before its password is checked: none until the
    username has failed TELEMACHUS_LOGIN_SLOWDOWN_AFTER times in its window (from anywhere), then
    doubling with each failure, capped."""
    name = _name(username)
    if not name:
        return 0.0
    failures = cache.get(_keys("user", name)[0], 0)
    beyond = failures - settings.TELEMACHUS_LOGIN_SLOWDOWN_AFTER
    if beyond < 0:
        return 0.0
    base, cap = settings.TELEMACHUS_LOGIN_SLOWDOWN_SECONDS, settings.TELEMACHUS_LOGIN_SLOWDOWN_MAX_SECONDS
    return min(base * 2 ** min(beyond, 32), cap)


def signin_failure_record(*, username: str, address: str | None) -> None:
    """Count one failed sign-in against the username at the address, the address and the
    username (atomic increments)."""
    window = settings.TELEMACHUS_LOGIN_WINDOW_SECONDS
    for kind, value in _counted(username, address or ""):
        if not value:
            continue
        count_key, since_key = _keys(kind, value)
        cache.add(since_key, time.time(), timeout=window)
        cache.add(count_key, 0, timeout=window)
        try:
            cache.incr(count_key)
        except ValueError:  # expired between add and incr: a new window
            cache.set(count_key, 1, timeout=window)


def signin_failures_clear(*, username: str, address: str) -> None:
    """After a successful sign-in: the username's failures at this address are forgiven."""
    if pair := _pair(username, address):
        cache.delete_many(_keys("pair", pair))


@receiver(user_login_failed)
def _failed(sender: Any, credentials: dict, request: HttpRequest | None = None, **kwargs: Any) -> None:
    username = credentials.get("username") or ""
    signin_failure_record(username=username, address=client_address(request) if request is not None else None)


@receiver(user_logged_in)
def _succeeded(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    if request is not None:
        signin_failures_clear(username=user.get_username(), address=client_address(request))


def attempts_limited(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Refuse a sign-in POST with 429 while its username at its address, or its address, is over
    its limit; slow it while its username is (see the module's docstring)."""

    @wraps(view)
    def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method == "POST":
            username = request.POST.get("username", "")
            wait = signin_retry_after(username=username, address=client_address(request))
            if wait is None and (delay := signin_delay(username=username)):
                time.sleep(delay)
            if wait is not None:
                response = HttpResponse(
                    f"Too many failed sign-ins. Try again in {wait} seconds.\n",
                    status=429,
                    content_type="text/plain; charset=utf-8",
                )
                response["Retry-After"] = str(wait)
                return response
        return view(request, *args, **kwargs)

    return limited
