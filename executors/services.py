from typing import Any

from asgiref.sync import async_to_sync
from django.db import transaction
from django.db.models import ProtectedError

from executors.contract import DispatchError
from executors.credentials import transport_resealed, transport_sealed, transport_shown
from executors.models import Executor
from executors.registry import driver_for
from telemachus.control.audit import Actor, audit_record, changed_fields
from telemachus.db.locks import Level, rows_lock
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


def _stored_view(executor: Executor) -> dict[str, Any]:
    return {
        name: (executor.team.slug if executor.team else None) if name == "team" else getattr(executor, name)
        for name in AUDITED
    }


def executor_audit_view(executor: Executor) -> dict[str, Any]:
    """An executor as the audit log records it: its secrets masked (executors/credentials.py)."""
    view = _stored_view(executor)
    return {**view, "transport": transport_shown(view["transport"])}


def _name_taken(name: Any) -> ValidationFailed:
    return ValidationFailed({"name": [f"An executor named {name!r} already exists."]})


def executor_create(*, by: Actor = None, **fields: Any) -> Executor:
    """Register an executor; audited (`executor.create`), its secrets sealed and masked. A name
    taken meanwhile by a concurrent create is refused as the API's check refuses it (400)."""
    if "transport" in fields:
        fields["transport"] = transport_sealed(fields["transport"] or {}, stored=None)
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
    A new transport's secrets are sealed (a shown mask keeps the secret stored at its place:
    executors/credentials.py). Audited with the changed fields before and after, secrets masked
    (nothing is written when nothing changes)."""
    if "transport" in fields:
        fields["transport"] = transport_sealed(fields["transport"] or {}, stored=executor.transport)
    stored, shown = _stored_view(executor), executor_audit_view(executor)
    for name, value in fields.items():
        setattr(executor, name, value)
    changed = changed_fields(stored, _stored_view(executor))[1]
    if not changed:
        return executor
    after = executor_audit_view(executor)
    with unique_or(_name_taken(fields.get("name"))), transaction.atomic():
        executor.save(update_fields=[*fields, "updated_at"])
        audit_record(
            by=by,
            action=action,
            object_type="executor",
            object_id=executor.pk,
            object_repr=executor.name,
            before={name: shown[name] for name in changed},
            after={name: after[name] for name in changed},
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


def executor_secrets_rotate(*, by: Actor = None) -> list[str]:
    """Seal every stored secret again under the current sealing key (executors/sealing.py: put the
    new key first, run this, then drop the old key). One transaction that locks the executor rows
    (level 2), so no edit made meanwhile is overwritten; the write moves the configuration version,
    so workers build their drivers again. Audited per executor resealed (`executor.secrets_rotate`:
    its masks do not change). Raises SecretUnreadable, changing nothing, for a secret no configured
    key unseals. Returns the names of the executors resealed."""
    rotated = []
    with transaction.atomic():
        for executor in rows_lock(Executor.objects.order_by("pk"), level=Level.EXECUTOR):
            resealed = transport_resealed(executor.transport)
            if resealed == executor.transport:
                continue
            executor.transport = resealed
            executor.save(update_fields=["transport", "updated_at"])
            audit_record(
                by=by,
                action="executor.secrets_rotate",
                object_type="executor",
                object_id=executor.pk,
                object_repr=executor.name,
            )
            rotated.append(executor.name)
    return rotated
