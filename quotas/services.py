from typing import Any

from quotas.models import QuotaPolicy


def quota_policy_create(**fields: Any) -> QuotaPolicy:
    return QuotaPolicy.objects.create(**fields)


def quota_policy_update(*, policy: QuotaPolicy, **fields: Any) -> QuotaPolicy:
    """The write moves the configuration version (by trigger), so the next claim and submit read
    the rules again and a new limit applies at once; on PostgreSQL a raised cap wakes the workers."""
    for name, value in fields.items():
        setattr(policy, name, value)
    policy.save(update_fields=[*fields, "updated_at"])
    return policy


def quota_policy_delete(*, policy: QuotaPolicy) -> None:
    policy.delete()
