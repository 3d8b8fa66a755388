"""Quota rules: what makes one well-formed (shared by the API serializer and the admin form), and
all of them loaded at once for the claim and admission."""

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from executors.models import Executor
from quotas.models import QuotaPolicy
from telemachus.keys.models import ApiKey
from telemachus.models import Team

Scope, Dimension = QuotaPolicy.Scope, QuotaPolicy.Dimension
SUBJECT_HINTS: dict[str, str] = {
    Scope.EXECUTOR: "executor name",
    Scope.TEAM: "team slug",
    Scope.USER: "username",
    Scope.KEY: "API key id",
}

# For each scope with subjects: its rows, the field that names one, and the field whose value a
# job is matched on. A key rule counts the jobs of the key's own user (an API key acts as a user of
# its own: telemachus/keys/), so its slots and budgets are that user's.
SubjectSource = tuple[Callable[[], QuerySet[Any]], str, str]
_subjects: dict[str, SubjectSource] = {
    Scope.EXECUTOR: (Executor.objects.all, "name", "pk"),
    Scope.TEAM: (Team.objects.all, "slug", "pk"),
    Scope.USER: (lambda: get_user_model().objects.all(), "username", "pk"),
    Scope.KEY: (lambda: ApiKey.objects.filter(principal__isnull=False), "pk", "principal_id"),
}


def subject_exists(scope: str, subject: str) -> bool:
    if scope not in _subjects or (scope == Scope.KEY and not (subject.isascii() and subject.isdigit())):
        return False
    rows, field, _ = _subjects[scope]
    return rows().filter(**{field: subject}).exists()


def quota_rule_errors(
    *, scope: str, subject: str, dimension: str, window: str, exclude_pk: int | None = None
) -> dict[str, list[str]]:
    """Per-field errors for a rule in storage form ("" for no subject / no window); empty if valid."""
    errors: dict[str, list[str]] = {}
    if scope == Scope.GLOBAL and subject:
        errors["subject"] = ["The global scope takes no subject."]
    elif scope != Scope.GLOBAL and not subject:
        errors["subject"] = [f"A {scope} rule needs a subject (the {SUBJECT_HINTS.get(scope, 'subject')})."]
    elif scope != Scope.GLOBAL and not subject_exists(scope, subject):
        errors["subject"] = [f"No {SUBJECT_HINTS.get(scope, 'subject')} {subject!r}."]
    if dimension == Dimension.CONCURRENCY and window:
        errors["window"] = ["ai.concurrency caps live slots; it takes no window."]
    elif dimension != Dimension.CONCURRENCY and not window:
        errors["window"] = [f"{dimension} needs a window: {', '.join(QuotaPolicy.Window.values)}."]
    if not errors:
        clash = QuotaPolicy.objects.filter(scope=scope, subject=subject, dimension=dimension, window=window)
        if exclude_pk is not None:
            clash = clash.exclude(pk=exclude_pk)
        if clash.exists():
            errors["non_field_errors"] = ["A rule for this scope, subject, dimension and window exists."]
    return errors


@dataclass(frozen=True)
class Rule:
    """A quota rule with its subject resolved to an id (team, user or executor; for a key, the
    key's user), for matching jobs. `limit` is an int, an amount (Decimal) for `ai.cost`."""

    pk: int
    scope: str
    subject: str
    dimension: str
    limit: Any  # int, or Decimal for ai.cost
    window: str
    subject_id: int | None

    def applies(self, *, team_id: int, user_id: int, executor_id: int | None = None) -> bool:
        """Whether the rule counts a job of this team and user (on this executor, if known)."""
        if self.scope == Scope.GLOBAL:
            return True
        if self.scope == Scope.TEAM:
            return self.subject_id == team_id
        if self.scope in (Scope.USER, Scope.KEY):
            return self.subject_id == user_id
        return executor_id is not None and self.subject_id == executor_id


def quota_rules(
    *, dimensions: tuple[str, ...] | None = None, known: dict[str, dict[str, int]] | None = None
) -> list[Rule]:
    """Quota rules (of these dimensions, or all), subjects resolved to ids (None when the subject
    is gone). Plain queries: one for the rules, one per scope whose rules name subjects, unless
    the caller already holds that scope's name -> id map (`known`; the claim has teams and
    executors loaded). The claim runs this every time, so it avoids costlier compiled forms."""
    rules = QuotaPolicy.objects.all()
    if dimensions is not None:
        rules = rules.filter(dimension__in=dimensions)
    rows = list(rules.values_list("pk", "scope", "subject", "dimension", "limit", "window"))
    ids: dict[str, dict[str, int]] = dict(known or {})
    for scope, (subjects, field, matched) in _subjects.items():
        names = {row[2] for row in rows if row[1] == scope}
        if scope == Scope.KEY:
            names = {name for name in names if name.isascii() and name.isdigit()}
        if names and scope not in ids:
            found = subjects().filter(**{f"{field}__in": names}).values_list(field, matched)
            ids[scope] = {str(name): pk for name, pk in found}
    return [
        Rule(pk, scope, subject, dimension, _limit(dimension, limit), window, ids.get(scope, {}).get(subject))
        for pk, scope, subject, dimension, limit, window in rows
    ]


def _limit(dimension: str, stored: Decimal) -> int | Decimal:
    return Decimal(stored) if dimension == Dimension.COST else int(stored)
