from typing import Any

from django.db import transaction

from scheduler.core.locks import lock_claim
from scheduler.models import QueuePolicy
from telemachus.control.audit import Actor, audit_record

EDITABLE = (
    "team_weights",
    "default_weight",
    "cost",
    "half_life_seconds",
    "entry_penalty",
    "aging_after_seconds",
    "aging_step_seconds",
    "aging_max_boost",
    "max_queue_depth",
    "priority_map",
    "priority_over_limit",
    "placement",
    "recovery",
    "max_attempts",
    "policy_class",
    "share_window_seconds",
    "flow_rounds",
    "affinity",
    "affinity_wait_ms",
    "batch_share",
)


def queue_policy_update(*, changes: dict[str, Any], by: Actor) -> QueuePolicy:
    """Edit the queue policy (fields validated by the caller) and audit it: one `queue_policy.update`
    audit event with the changed fields' values before and after. Takes the claim lock (level 1), so the change
    lands between two claims and applies to the next one, on every worker, without a restart."""
    unknown = set(changes) - set(EDITABLE)
    if unknown:
        raise ValueError(f"not editable: {', '.join(sorted(unknown))}")
    with transaction.atomic():
        record, now = lock_claim(as_stored=True)
        changed = {name: value for name, value in changes.items() if getattr(record, name) != value}
        if not changed:
            return record
        before = {name: getattr(record, name) for name in changed}
        for name, value in changed.items():
            setattr(record, name, value)
        record.save(update_fields=[*changed, "updated_at"])
        audit_record(
            by=by,
            action="queue_policy.update",
            object_type="queue_policy",
            object_id=record.pk,
            object_repr=str(record),
            before=before,
            after=changed,
        )
    return record
