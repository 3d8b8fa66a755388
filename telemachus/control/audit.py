"""The audit log: one writer for AuditEvent rows, called by every service that carries out a
person's change (executors, quota rules, teams and members, grants, the queue policy, feature
switches, users, job cancel and requeue), in the transaction of the change.

Which surface a change came through (API, admin, dashboard) is known to the interface, not the
service: each interface sets it around its calls with `audit_source`, and the services stay
unaware of it.

No secret is written: services record secrets masked (executors' credentials: executors/credentials.py),
and as a second line every string under a name that reads as a secret's (`is_secret_name`: an
API key, a password, a token, an Authorization header...) is masked here, at any depth."""

import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.contrib.auth.models import AnonymousUser, User

from telemachus.control.notify import changes_notify
from telemachus.models import AuditEvent

_source: ContextVar[str] = ContextVar("audit_source", default=AuditEvent.Source.SYSTEM)


@contextmanager
def audit_source(source: str) -> Iterator[None]:
    """Changes made inside this block are recorded as coming through `source`."""
    token = _source.set(source)
    try:
        yield
    finally:
        _source.reset(token)


# Who acted, as a request carries it (None: the system). Anonymous callers are recorded as the system.
Actor = User | AnonymousUser | None

MASK = "********"
_SECRET_WORDS = {
    "apikey",
    "auth",
    "authorization",
    "bearer",
    "cookie",
    "credential",
    "credentials",
    "passphrase",
    "passwd",
    "password",
    "privatekey",
    "pwd",
    "secret",
    "secrets",
    "token",
}
_SECRET_PAIRS = {
    ("api", "key"),
    ("access", "key"),
    ("private", "key"),
    ("secret", "key"),
    ("client", "secret"),
    ("subscription", "key"),
}


def is_secret_name(name: str) -> bool:
    """Whether a field or header name reads as a secret's: `api_key`, `X-Api-Key`, `apiKey`,
    `password`, `Authorization`, `access_token`... and not `max_tokens` or `api_key_env` (the
    name of an environment variable, not its value). Words are split at punctuation and case."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
    parts = [w for w in re.split(r"[^a-z0-9]+", words) if w]
    if not parts or parts[-1] == "env":
        return False
    return bool(_SECRET_WORDS.intersection(parts)) or any(pair in _SECRET_PAIRS for pair in itertools.pairwise(parts))


def audit_masked(value: Any) -> Any:
    """The value with every non-empty string under a secret's name masked, at any depth."""
    if isinstance(value, dict):
        return {
            key: MASK
            if isinstance(key, str)
            and is_secret_name(key)
            and isinstance(item, str)
            and item
            and not item.startswith(MASK)
            else audit_masked(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [audit_masked(item) for item in value]
    return value


def audit_record(
    *,
    by: Actor,
    action: str,
    object_type: str,
    object_id: Any,
    object_repr: str = "",
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> AuditEvent:
    """Write one audit event: `by` (None for the system) did `action` (`<object_type>.<verb>`) to
    the object, whose audited fields were `before` and are `after` (None for a create's before and a
    delete's after; secrets masked: `audit_masked`). Call inside the transaction of the change, so
    the event exists exactly when the change does. Tells live dashboards on commit."""
    actor = by if by is not None and by.is_authenticated else None
    event = AuditEvent.objects.create(
        actor=actor,
        actor_name=actor.get_username() if actor else "",
        source=_source.get(),
        action=action,
        object_type=object_type,
        object_id=str(object_id),
        object_repr=str(object_repr)[:200],
        before=audit_masked(before),
        after=audit_masked(after),
    )
    changes_notify("audit")
    return event


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields whose value differs, as (before, after) restricted to them."""
    names = [name for name in after if before.get(name) != after[name]]
    return {name: before.get(name) for name in names}, {name: after[name] for name in names}
