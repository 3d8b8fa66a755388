"""Executor alerts: `executor.down` when a probe finds an executor down, `executor.up` when one
that was down answers a probe again, `breaker.opened` when its circuit breaker opens. Sent to the
webhooks of the teams that may use the executor (every team, for a shared one), from
`events_record` (executors/health.py), in the transaction of the change."""

from collections.abc import Sequence
from typing import TYPE_CHECKING

from executors.models import Executor
from executors.selectors import executor_teams
from telemachus.models import Webhook
from telemachus.webhooks.services import WebhookEvent, webhooks_emit

if TYPE_CHECKING:
    from executors.health import ExecutorEvent


def _webhook_type(event: "ExecutorEvent") -> str | None:
    from executors.health import BREAKER_OPENED, HEALTH_CHANGED

    if event.event == BREAKER_OPENED:
        return Webhook.Event.BREAKER_OPENED
    if event.event == HEALTH_CHANGED and event.meta.get("health") == Executor.Health.DOWN:
        return Webhook.Event.EXECUTOR_DOWN
    if event.event == HEALTH_CHANGED and event.meta.get("was") == Executor.Health.DOWN:
        return Webhook.Event.EXECUTOR_UP
    return None


def executor_events_emit(events: Sequence["ExecutorEvent"]) -> int:
    """Emit the events a team acts on (see the module's docstring); no query for the others (a
    breaker closing or going half open, a health change between ok and degraded)."""
    typed = [(kind, event) for event in events if (kind := _webhook_type(event)) is not None]
    if not typed:
        return 0
    executors = {e.pk: e for e in Executor.objects.filter(pk__in={event.executor_id for _, event in typed})}
    granted = executor_teams(executors=executors.values())
    alerts = []
    for kind, event in typed:
        executor = executors.get(event.executor_id)
        if executor is None:
            continue
        teams = None if executor.team_id is None else frozenset(granted.get(executor.pk, {executor.team_id}))
        alerts.append(
            WebhookEvent(
                type=kind,
                data={
                    "executor": {"id": executor.pk, "name": executor.name, "kind": executor.kind},
                    "at": event.at.isoformat(),
                    **{key: value for key, value in event.meta.items() if key != "executor_name"},
                },
                teams=teams,
            )
        )
    return webhooks_emit(events=alerts)
