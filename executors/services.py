from typing import Any

from asgiref.sync import async_to_sync
from django.db import transaction
from django.db.models import ProtectedError

from executors.contract import DispatchError
from executors.models import Executor
from executors.registry import driver_for
from telemachus.errors import Conflict, ExecutorUnreachable


def executor_create(**fields: Any) -> Executor:
    return Executor.objects.create(**fields)


def executor_update(*, executor: Executor, **fields: Any) -> Executor:
    """Apply an operator's edit. The write moves the configuration version (by trigger), so the
    next claim and submit read the row again and a change to `enabled`, `max_concurrency` or
    `capabilities` takes effect without restarting workers; on PostgreSQL it also wakes them."""
    for name, value in fields.items():
        setattr(executor, name, value)
    executor.save(update_fields=[*fields, "updated_at"])
    return executor


def executor_delete(*, executor: Executor) -> None:
    """An executor that holds live slots cannot go: disable it, let its work drain, then delete."""
    try:
        with transaction.atomic():
            executor.delete()
    except ProtectedError:
        raise Conflict(f"Executor {executor.name!r} is running jobs; disable it and retry when they finish.") from None


def executor_sync(*, executor: Executor) -> Executor:
    """Read the models the executor serves (GET {endpoint}/models for model servers) into
    `capabilities.models`. Other capabilities are kept. A kind that does not report its models is
    a conflict; an executor that does not answer is a 502."""
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
    return executor_update(executor=executor, capabilities={**executor.capabilities, "models": models})
