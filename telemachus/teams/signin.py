"""Sign-in attempt limiting for the admin's and the dashboard's login forms.

Failed sign-ins are counted per username (whatever address they come from) and per client address
(whatever usernames it tries), each over a window that starts at the first failure. Past either
limit the form answers `429 Too Many Requests` with Retry-After, before the password is checked,
until the window ends; a successful sign-in clears its username's count. Counts live in Django's
cache: per process by default (one API process is the `make run` case), shared through Redis when
REDIS_URL is set, so every API server sees the same counts.

Django's `user_login_failed` and `user_logged_in` signals feed it, so any form that authenticates
with the request counts; `attempts_limited` wraps the views that must refuse early. Built here
rather than with django-axes: axes requires the request in every `authenticate()` call (the test
client's `login()` has none), adds three tables and its own admin, and trusts X-Forwarded-For by
default; this needs the cache and two signals."""

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


def _limits(username: str, address: str) -> list[tuple[str, str, int]]:
    return [
        ("user", username.strip().lower(), settings.TELEMACHUS_LOGIN_FAILURES_PER_USERNAME),
        ("addr", address, settings.TELEMACHUS_LOGIN_FAILURES_PER_ADDRESS),
    ]


def signin_retry_after(*, username: str, address: str) -> int | None:
    """Seconds until this username and address may try again, or None when they may now."""
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


def signin_failure_record(*, username: str, address: str | None) -> None:
    """Count one failed sign-in against the username and the address (atomic increments)."""
    window = settings.TELEMACHUS_LOGIN_WINDOW_SECONDS
    for kind, value, _ in _limits(username, address or ""):
        if not value:
            continue
        count_key, since_key = _keys(kind, value)
        cache.add(since_key, time.time(), timeout=window)
        cache.add(count_key, 0, timeout=window)
        try:
            cache.incr(count_key)
        except ValueError:  # expired between add and incr: a new window
            cache.set(count_key, 1, timeout=window)


def signin_failures_clear(*, username: str) -> None:
    cache.delete_many(_keys("user", username.strip().lower()))


@receiver(user_login_failed)
def _failed(sender: Any, credentials: dict, request: HttpRequest | None = None, **kwargs: Any) -> None:
    username = credentials.get("username") or ""
    signin_failure_record(username=username, address=client_address(request) if request is not None else None)


@receiver(user_logged_in)
def _succeeded(sender: Any, request: HttpRequest | None, user: Any, **kwargs: Any) -> None:
    signin_failures_clear(username=user.get_username())


def attempts_limited(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Refuse a sign-in POST with 429 while its username or address is over its limit."""

    @wraps(view)
    def limited(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method == "POST":
            wait = signin_retry_after(username=request.POST.get("username", ""), address=client_address(request))
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
