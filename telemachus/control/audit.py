"""The audit log: one writer for AuditEvent rows, called by every service that carries out a
person's change (executors, quota rules, teams and members, grants, the queue policy, feature
switches, users, job cancel and requeue), in the transaction of the change.

Which surface a change came through (API, admin, dashboard) is known to the interface, not the
service: each interface sets it around its calls with `audit_source`, and the services stay
unaware of it."""

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
    delete's after). Call inside the transaction of the change, so the event exists exactly when
    the change does. Tells live dashboards on commit."""
    actor = by if by is not None and by.is_authenticated else None
    event = AuditEvent.objects.create(
        actor=actor,
        actor_name=actor.get_username() if actor else "",
        source=_source.get(),
        action=action,
        object_type=object_type,
        object_id=str(object_id),
        object_repr=str(object_repr)[:200],
        before=before,
        after=after,
    )
    changes_notify("audit")
    return event


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields whose value differs, as (before, after) restricted to them."""
    names = [name for name in after if before.get(name) != after[name]]
    return {name: before.get(name) for name in names}, {name: after[name] for name in names}
