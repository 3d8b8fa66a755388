from typing import Any

from django.db import transaction

from quotas.models import QuotaPolicy, limit_text
from telemachus.control.audit import Actor, audit_record, changed_fields
from telemachus.errors import ValidationFailed, unique_or

AUDITED = ("scope", "subject", "dimension", "limit", "window")


def _rule_exists() -> ValidationFailed:
    """As the API's check answers a rule that exists (quotas/rules.py), for one created meanwhile."""
    return ValidationFailed({"non_field_errors": ["A rule for this scope, subject, dimension and window exists."]})


def _view(policy: QuotaPolicy) -> dict[str, Any]:
    """The rule as the API shows it: no subject and no window are null."""
    view = {name: getattr(policy, name) for name in AUDITED}
    limit: int | str = limit_text(policy.dimension, policy.limit)
    if policy.dimension != QuotaPolicy.Dimension.COST:
        limit = int(limit)
    return {**view, "subject": view["subject"] or None, "window": view["window"] or None, "limit": limit}


def quota_policy_create(*, by: Actor = None, **fields: Any) -> QuotaPolicy:
    """A new rule; the next claim and submit apply it. Audited (`quota_policy.create`)."""
    with unique_or(_rule_exists()), transaction.atomic():
        policy = QuotaPolicy.objects.create(**fields)
        audit_record(
            by=by,
            action="quota_policy.create",
            object_type="quota_policy",
            object_id=policy.pk,
            object_repr=str(policy),
            after=_view(policy),
        )
    return policy


def quota_policy_update(*, policy: QuotaPolicy, by: Actor = None, **fields: Any) -> QuotaPolicy:
    """The write moves the configuration version (by trigger), so the next claim and submit read
    the rules again and a new limit applies at once; on PostgreSQL a raised cap wakes the workers.
    Audited with the changed fields before and after."""
    before = _view(policy)
    for name, value in fields.items():
        setattr(policy, name, value)
    was, now = changed_fields(before, _view(policy))
    if not now:
        return policy
    with unique_or(_rule_exists()), transaction.atomic():
        policy.save(update_fields=[*fields, "updated_at"])
        audit_record(
            by=by,
            action="quota_policy.update",
            object_type="quota_policy",
            object_id=policy.pk,
            object_repr=str(policy),
            before=was,
            after=now,
        )
    return policy


def quota_policy_delete(*, policy: QuotaPolicy, by: Actor = None) -> None:
    pk, before, label = policy.pk, _view(policy), str(policy)
    with transaction.atomic():
        policy.delete()
        audit_record(
            by=by,
            action="quota_policy.delete",
            object_type="quota_policy",
            object_id=pk,
            object_repr=label,
            before=before,
        )
