"""What an operator does from the live dashboard: the same services, permission checks and input
serializers as the API, reached over the dashboard's WebSocket instead of HTTP (the socket's
Origin check and session stand in for the CSRF token of a form). Members' sockets get 403.

A message has been through the API's body checks already (scheduler/live/consumers.py: nesting,
storable text, finite numbers); each action's own fields (ids, changes) are checked by serializers
as the API checks its input, so a bad one is a validation error, never a database error."""

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
from telemachus.http.bounds import ID_MAX
from telemachus.http.serializers import StrictSerializer
from telemachus.models import AuditEvent
from telemachus.teams import rbac

# What the dashboard may change on an executor; the rest is the API's and the admin's.
EXECUTOR_FIELDS = {"max_concurrency", "enabled"}


def _validated(serializer: serializers.Serializer) -> dict[str, Any]:
    if not serializer.is_valid():
        raise ValidationFailed(serializer.errors)
    return serializer.validated_data


class ActionInput(StrictSerializer):
    """Every action's message: its name, and an `id` of the client's choosing that the reply
    echoes. Strict, as the API's input is: a key the action does not take is refused."""

    id = serializers.JSONField(required=False)
    action = serializers.CharField()


class JobActionInput(ActionInput):
    job = serializers.IntegerField(min_value=1, max_value=ID_MAX)


class ExecutorActionInput(ActionInput):
    executor = serializers.IntegerField(min_value=1, max_value=ID_MAX)
    changes = serializers.DictField()


class ChangesActionInput(ActionInput):
    changes = serializers.DictField()


def _policy_update(user: rbac.Principal, payload: dict[str, Any]) -> None:
    changes = _validated(ChangesActionInput(data=payload))["changes"]
    queue_policy_update(changes=dict(_validated(PolicyInput(data=changes))), by=user)


def _executor_update(user: rbac.Principal, payload: dict[str, Any]) -> None:
    message = _validated(ExecutorActionInput(data=payload))
    executor = Executor.objects.select_related("team").filter(pk=message["executor"]).first()
    if executor is None:
        raise NotFound(f"Executor {message['executor']} not found.")
    changes = message["changes"]
    if not changes or set(changes) - EXECUTOR_FIELDS:
        raise ValidationFailed({"changes": [f"Change one or more of: {', '.join(sorted(EXECUTOR_FIELDS))}."]})
    executor_update(executor=executor, by=user, **_validated(ExecutorInput(executor, data=changes, partial=True)))


def _job_cancel(user: rbac.Principal, payload: dict[str, Any]) -> None:
    job_id = _validated(JobActionInput(data=payload))["job"]
    job = visible_jobs(user).filter(pk=job_id).select_related("team").first()
    if job is None:
        raise NotFound(f"Job {job_id} not found.")
    require_cancel(user, job)
    job_cancel(job_id=job_id, by=user)


def _job_requeue(user: rbac.Principal, payload: dict[str, Any]) -> None:
    job_requeue(job_id=_validated(JobActionInput(data=payload))["job"], by=user)


def _feature_set(user: rbac.Principal, payload: dict[str, Any]) -> None:
    changes = _validated(ChangesActionInput(data=payload))["changes"]
    data = _validated(FeatureSwitchInput(data=changes))
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
        action = message.get("action") if isinstance(message, dict) else None
        if not isinstance(action, str) or action not in ACTIONS:
            raise ValidationFailed({"action": [f"One of: {', '.join(ACTIONS)}."]})
        rbac.require_operator(user)
        with audit_source(AuditEvent.Source.DASHBOARD):
            ACTIONS[action](user, message)
    except DomainError as exc:
        return {"ok": False, "error": exc.body()}
    return {"ok": True}
