"""Budget alerts: a token or money budget past 80 % (`budget.threshold`) or 100 %
(`budget.exhausted`) of its limit in its window, sent to the webhooks of the teams it concerns.

Which teams a budget concerns: a team budget its team; a user or key budget the teams of the jobs
that moved it (a key's jobs are its team's); an executor budget the teams that may use the
executor (every team, for a shared one); a global budget every team. Called by `quota_settle`
(quotas/budget.py), which finds the crossings, inside the transaction that settles them."""

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from executors.models import Executor
from executors.selectors import executor_teams
from quotas.models import QuotaPolicy
from telemachus.models import Webhook
from telemachus.webhooks.services import WebhookEvent, webhooks_emit

if TYPE_CHECKING:
    from quotas.budget import Bill, Crossing
    from quotas.rules import Rule

Scope = QuotaPolicy.Scope


def budget_teams(rule: "Rule", *, bills: Sequence["Bill"]) -> frozenset[int] | None:
    """The ids of the teams a budget concerns (None: every team). One or two queries for an
    executor's budget, none otherwise."""
    if rule.scope == Scope.GLOBAL:
        return None
    if rule.subject_id is None:
        return frozenset()
    if rule.scope == Scope.TEAM:
        return frozenset({rule.subject_id})
    if rule.scope in (Scope.USER, Scope.KEY):
        return frozenset(bill.team_id for bill in bills if bill.user_id == rule.subject_id)
    executor = Executor.objects.filter(pk=rule.subject_id).only("pk", "team_id").first()
    if executor is None:
        return frozenset()
    if executor.team_id is None:
        return None
    return frozenset(executor_teams(executors=[executor]).get(executor.pk, {executor.team_id}))


def budget_thresholds_emit(*, crossings: Sequence["Crossing"], bills: Sequence["Bill"], now: datetime) -> int:
    """Emit one event per crossing (see the module's docstring); returns the deliveries written."""
    events = []
    for crossing in crossings:
        account, rule = crossing.account, crossing.account.rule
        events.append(
            WebhookEvent(
                type=Webhook.Event.BUDGET_EXHAUSTED if crossing.percent >= 100 else Webhook.Event.BUDGET_THRESHOLD,
                data={
                    "budget": {
                        "rule": rule.pk,
                        "scope": rule.scope,
                        "subject": rule.subject or None,
                        "dimension": rule.dimension,
                        "window": rule.window,
                        "limit": account.show(rule.limit),
                    },
                    "threshold_percent": crossing.percent,
                    "used": account.show(crossing.used),
                    "window_start": account.start.isoformat(),
                    "reset_at": account.end.isoformat(),
                },
                teams=budget_teams(rule, bills=bills),
            )
        )
    return webhooks_emit(events=events, at=now)
