from typing import Any

from django.db import transaction
from django.db.models import ProtectedError

from executors.models import Executor
from telemachus.errors import Conflict


def executor_create(**fields: Any) -> Executor:
    return Executor.objects.create(**fields)


def executor_update(*, executor: Executor, **fields: Any) -> Executor:
    """Apply an operator's edit. The next claim reads the row afresh, so a change to `enabled`,
    `max_concurrency` or `capabilities` takes effect without restarting workers."""
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
