"""What makes a quota rule well-formed; shared by the API serializer and the admin form."""

from django.contrib.auth import get_user_model

from executors.models import Executor
from quotas.models import QuotaPolicy
from telemachus.models import Team

Scope, Dimension = QuotaPolicy.Scope, QuotaPolicy.Dimension
SUBJECT_HINTS = {Scope.EXECUTOR: "executor name", Scope.TEAM: "team slug", Scope.USER: "username"}


def subject_exists(scope: str, subject: str) -> bool:
    if scope == Scope.EXECUTOR:
        return Executor.objects.filter(name=subject).exists()
    if scope == Scope.TEAM:
        return Team.objects.filter(slug=subject).exists()
    if scope == Scope.USER:
        return get_user_model().objects.filter(username=subject).exists()
    return False


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
        if clash.exclude(pk=exclude_pk).exists():
            errors["non_field_errors"] = ["A rule for this scope, subject, dimension and window exists."]
    return errors
