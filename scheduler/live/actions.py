"""What an operator does from the live dashboard: the same services, permission checks and input
serializers as the API, reached over the dashboard's WebSocket instead of HTTP (the socket's
Origin check and session stand in for the CSRF token of a form). Members' sockets get 403."""

from typing import Any

from rest_framework import serializers

from executors.api import ExecutorInput
from executors.models import Executor
from executors.services import executor_update
from scheduler.api.policy import PolicyInput
from scheduler.rbac import require_cancel, visible_jobs
from scheduler.services.cancel import job_cancel
from scheduler.services.policy import queue_policy_update
from scheduler.services.requeue import job_requeue
from telemachus.control.audit import audit_source
from telemachus.control.features import feature_set
from telemachus.control.features_api import FeatureSwitchInput
from telemachus.errors import DomainError, NotFound, ValidationFailed
from telemachus.models import AuditEvent
from telemachus.teams import rbac

# What the dashboard may change on an executor; the rest is the API's and the admin's.
EXECUTOR_FIELDS = {"max_concurrency", "enabled"}


def _validated(serializer: serializers.Serializer) -> dict[str, Any]:
    if not serializer.is_valid():
        raise ValidationFailed(serializer.errors)
    return serializer.validated_data


def _job_id(payload: dict[str, Any]) -> int:
    job_id = payload.get("job")
    if not isinstance(job_id, int) or isinstance(job_id, bool):
        raise ValidationFailed({"job": ["A job id (an integer) is required."]})
    return job_id


def _policy_update(user: rbac.Principal, payload: dict[str, Any]) -> None:
    queue_policy_update(changes=dict(_validated(PolicyInput(data=payload.get("changes")))), by=user)


def _executor_update(user: rbac.Principal, payload: dict[str, Any]) -> None:
    executor = Executor.objects.select_related("team").filter(pk=payload.get("executor")).first()  # type: ignore[misc]
    if executor is None:
        raise NotFound(f"Executor {payload.get('executor')!r} not found.")
    changes = payload.get("changes")
    if not isinstance(changes, dict) or not changes or set(changes) - EXECUTOR_FIELDS:
        raise ValidationFailed({"changes": [f"Change one or more of: {', '.join(sorted(EXECUTOR_FIELDS))}."]})
    executor_update(executor=executor, by=user, **_validated(ExecutorInput(executor, data=changes, partial=True)))


def _job_cancel(user: rbac.Principal, payload: dict[str, Any]) -> None:
    job_id = _job_id(payload)
    job = visible_jobs(user).filter(pk=job_id).select_related("team").first()
    if job is None:
        raise NotFound(f"Job {job_id} not found.")
    require_cancel(user, job)
    job_cancel(job_id=job_id, by=user)


def _job_requeue(user: rbac.Principal, payload: dict[str, Any]) -> None:
    job_requeue(job_id=_job_id(payload), by=user)


def _feature_set(user: rbac.Principal, payload: dict[str, Any]) -> None:
    data = _validated(FeatureSwitchInput(data=payload.get("changes")))
    feature_set(**{"team": None, **data}, by=user)


ACTIONS = {
    "policy.update": _policy_update,
    "executor.update": _executor_update,
    "job.cancel": _job_cancel,
    "job.requeue": _job_requeue,
    "feature.set": _feature_set,
}


def dashboard_action(*, user: rbac.Principal, message: Any) -> dict[str, Any]:
    """Carry out one action sent by a dashboard: `{"action": "<name>", ...its fields}`. Operators
    only. Returns the reply for the socket: `{"ok": true}` or `{"ok": false, "error": {...}}` in the
    API's error shape. Each service audits its change as coming from the dashboard."""
    try:
        if not isinstance(message, dict) or message.get("action") not in ACTIONS:
            raise ValidationFailed({"action": [f"One of: {', '.join(ACTIONS)}."]})
        rbac.require_operator(user)
        with audit_source(AuditEvent.Source.DASHBOARD):
            ACTIONS[message["action"]](user, message)
    except DomainError as exc:
        return {"ok": False, "error": exc.body()}
    return {"ok": True}
