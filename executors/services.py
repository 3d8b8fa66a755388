from typing import Any

from asgiref.sync import async_to_sync
from django.db import transaction
from django.db.models import ProtectedError

from executors.contract import DispatchError
from executors.models import Executor
from executors.registry import driver_for
from telemachus.control.audit import Actor, audit_record, changed_fields
from telemachus.errors import Conflict, ExecutorUnreachable, ValidationFailed, unique_or

# What the audit log keeps of an executor (the runtime state, health and breaker, is not an edit).
AUDITED = (
    "name",
    "kind",
    "team",
    "endpoint",
    "capabilities",
    "max_concurrency",
    "enabled",
    "weight",
    "transport",
    "meta",
    "prices",
)


def executor_audit_view(executor: Executor) -> dict[str, Any]:
    return {
        name: (executor.team.slug if executor.team else None) if name == "team" else getattr(executor, name)
        for name in AUDITED
    }


def _name_taken(name: Any) -> ValidationFailed:
    return ValidationFailed({"name": [f"An executor named {name!r} already exists."]})


def executor_create(*, by: Actor = None, **fields: Any) -> Executor:
    """Register an executor; audited (`executor.create`). A name taken meanwhile by a concurrent
    create is refused as the API's check refuses it (400)."""
    with unique_or(_name_taken(fields.get("name"))), transaction.atomic():
        executor = Executor.objects.create(**fields)
        audit_record(
            by=by,
            action="executor.create",
            object_type="executor",
            object_id=executor.pk,
            object_repr=executor.name,
            after=executor_audit_view(executor),
        )
    return executor


def executor_update(
    *, executor: Executor, by: Actor = None, action: str = "executor.update", **fields: Any
) -> Executor:
    """Apply an operator's edit. The write moves the configuration version (by trigger), so the
    next claim and submit read the row again and a change to `enabled`, `max_concurrency` or
    `capabilities` takes effect without restarting workers; on PostgreSQL it also wakes them.
    Audited with the changed fields before and after (nothing is written when nothing changes)."""
    before = executor_audit_view(executor)
    for name, value in fields.items():
        setattr(executor, name, value)
    was, now = changed_fields(before, executor_audit_view(executor))
    if not now:
        return executor
    with unique_or(_name_taken(fields.get("name"))), transaction.atomic():
        executor.save(update_fields=[*fields, "updated_at"])
        audit_record(
            by=by,
            action=action,
            object_type="executor",
            object_id=executor.pk,
            object_repr=executor.name,
            before=was,
            after=now,
        )
    return executor


def executor_delete(*, executor: Executor, by: Actor = None) -> None:
    """An executor that holds live slots cannot go: disable it, let its work drain, then delete."""
    pk, before = executor.pk, executor_audit_view(executor)
    try:
        with transaction.atomic():
            executor.delete()
            audit_record(
                by=by,
                action="executor.delete",
                object_type="executor",
                object_id=pk,
                object_repr=before["name"],
                before=before,
            )
    except ProtectedError:
        raise Conflict(f"Executor {executor.name!r} is running jobs; disable it and retry when they finish.") from None


def executor_sync(*, executor: Executor, by: Actor = None) -> Executor:
    """Read the models the executor serves (GET {endpoint}/models for model servers) into
    `capabilities.models`. Other capabilities are kept. A kind that does not report its models is
    a conflict; an executor that does not answer is a 502. Audited (`executor.sync`)."""
    driver = driver_for(executor)

    async def fetch() -> list[str] | None:
        try:
            return await driver.list_models()
        finally:
            await driver.aclose()

    try:
        models = async_to_sync(fetch)()
    except DispatchError as exc:
        raise ExecutorUnreachable(str(exc)) from exc
    if models is None:
        raise Conflict(f"{executor.kind} executors do not report their models; set capabilities.models instead.")
    return executor_update(
        executor=executor, by=by, action="executor.sync", capabilities={**executor.capabilities, "models": models}
    )
