"""Registering webhooks, and emitting events into their outbox.

Who may register is the interface's check (a manager of the team, or an operator:
telemachus/webhooks/api.py); the services validate, write and audit. `webhooks_emit` is what the
layers above call (quotas for budgets, executors for health and breakers, the scheduler for
failed jobs), inside the transaction of the change they report."""

import base64
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from telemachus.control.audit import Actor, audit_record, changed_fields
from telemachus.errors import ValidationFailed
from telemachus.models import Team
from telemachus.webhooks.addresses import AddressRefused, webhook_target
from telemachus.webhooks.models import Webhook, WebhookDelivery

EVENTS = tuple(Webhook.Event.values)
# A team's receivers are a handful; the bound keeps one team from making every emission slow.
MAX_PER_TEAM = 20


@dataclass(frozen=True)
class WebhookEvent:
    """One event to deliver: its type (`Webhook.Event`), its `data` (JSON-ready; the receiving
    webhook's team slug is added as `team`), and the teams whose webhooks receive it (None: every
    team's, for what concerns all of them, like a global budget or a shared executor)."""

    type: str
    data: dict[str, Any]
    teams: frozenset[int] | None


def webhook_secret_new() -> str:
    """A Standard Webhooks secret: `whsec_` and the base64 of 32 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def webhook_audit_view(webhook: Webhook) -> dict[str, Any]:
    """A webhook as the audit log records it: everything but its secret."""
    return {
        "team": webhook.team.slug,
        "url": webhook.url,
        "events": list(webhook.events),
        "enabled": webhook.enabled,
        "description": webhook.description,
    }


def _url_errors(url: str) -> list[str]:
    try:
        webhook_target(url, allow_private=settings.TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE)
    except AddressRefused as exc:
        return [str(exc)]
    return []


def _events_errors(events: Sequence[str]) -> list[str]:
    unknown = sorted(set(events) - set(EVENTS))
    if unknown:
        return [f"Unknown event type(s) {', '.join(unknown)}; known: {', '.join(EVENTS)}."]
    if not events:
        return ["Name at least one event type."]
    return []


def webhook_create(
    *, team: Team, url: str, events: Sequence[str], description: str = "", by: Actor = None
) -> tuple[Webhook, str]:
    """A new webhook for `team`, and its secret (returned here only). The URL must resolve to
    public addresses (`webhook_target`); the events must be known types. Audited
    (`webhook.create`, without the secret)."""
    errors = {"url": _url_errors(url), "events": _events_errors(events)}
    if Webhook.objects.filter(team=team).count() >= MAX_PER_TEAM:
        errors["team"] = [f"Team {team.slug!r} has {MAX_PER_TEAM} webhooks, the most a team may have."]
    if any(errors.values()):
        raise ValidationFailed({field: messages for field, messages in errors.items() if messages})
    secret = webhook_secret_new()
    with transaction.atomic():
        webhook = Webhook.objects.create(
            team=team,
            url=url,
            events=list(dict.fromkeys(events)),
            description=description,
            secret=secret,
            created_by=by if isinstance(by, User) else None,
        )
        audit_record(
            by=by,
            action="webhook.create",
            object_type="webhook",
            object_id=webhook.pk,
            object_repr=str(webhook),
            after=webhook_audit_view(webhook),
        )
    return webhook, secret


def webhook_update(
    *,
    webhook: Webhook,
    url: str | None = None,
    events: Sequence[str] | None = None,
    enabled: bool | None = None,
    description: str | None = None,
    by: Actor = None,
) -> Webhook:
    """Change what is given; the URL is checked again. Audited (`webhook.update`, the changed
    fields before and after) when something changed."""
    errors = {
        "url": _url_errors(url) if url is not None else [],
        "events": _events_errors(events) if events is not None else [],
    }
    if any(errors.values()):
        raise ValidationFailed({field: messages for field, messages in errors.items() if messages})
    with transaction.atomic():
        before = webhook_audit_view(webhook)
        if url is not None:
            webhook.url = url
        if events is not None:
            webhook.events = list(dict.fromkeys(events))
        if enabled is not None:
            webhook.enabled = enabled
        if description is not None:
            webhook.description = description
        was, now = changed_fields(before, webhook_audit_view(webhook))
        if now:
            webhook.save(update_fields=["url", "events", "enabled", "description"])
            audit_record(
                by=by,
                action="webhook.update",
                object_type="webhook",
                object_id=webhook.pk,
                object_repr=str(webhook),
                before=was,
                after=now,
            )
    return webhook


def webhook_delete(*, webhook: Webhook, by: Actor = None) -> None:
    """Delete a webhook and its deliveries (pending ones are not sent). Audited (`webhook.delete`)."""
    with transaction.atomic():
        audit_record(
            by=by,
            action="webhook.delete",
            object_type="webhook",
            object_id=webhook.pk,
            object_repr=str(webhook),
            before=webhook_audit_view(webhook),
        )
        webhook.delete()


def webhooks_emit(*, events: Sequence[WebhookEvent], at: datetime | None = None) -> int:
    """Put the events in the outbox of every enabled webhook that subscribes to their type, in
    the teams they concern: one delivery row each, due now, with the body every attempt will send
    (`{"type", "timestamp", "data"}`, the Standard Webhooks shape). Runs in the caller's
    transaction, so the rows exist exactly when the change they report does, and locks nothing.
    One query for the webhooks and one insert, none without events; returns how many rows."""
    if not events:
        return 0
    hooks = Webhook.objects.filter(enabled=True).select_related("team")
    if all(event.teams is not None for event in events):
        hooks = hooks.filter(team_id__in=sorted(set().union(*(event.teams or () for event in events))))
    now = timezone.now()
    stamp = (at or now).astimezone(UTC).isoformat().replace("+00:00", "Z")
    rows = [
        WebhookDelivery(
            webhook=hook,
            message_id=f"msg_{uuid.uuid4().hex}",
            event=event.type,
            payload={"type": event.type, "timestamp": stamp, "data": {**event.data, "team": hook.team.slug}},
            created_at=now,
            next_attempt_at=now,
        )
        for hook in hooks
        for event in events
        if event.type in hook.events and (event.teams is None or hook.team_id in event.teams)
    ]
    WebhookDelivery.objects.bulk_create(rows)
    return len(rows)
