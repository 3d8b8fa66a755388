from typing import Any

from quotas.models import QuotaPolicy


def quota_policy_create(**fields: Any) -> QuotaPolicy:
    return QuotaPolicy.objects.create(**fields)


def quota_policy_update(*, policy: QuotaPolicy, **fields: Any) -> QuotaPolicy:
    """The claim reads quota rows afresh each time, so a new limit applies to the next claim."""
    for name, value in fields.items():
        setattr(policy, name, value)
    policy.save(update_fields=[*fields, "updated_at"])
    return policy


def quota_policy_delete(*, policy: QuotaPolicy) -> None:
    policy.delete()
