"""Tasks declared with Django's tasks API, as an app of a deployment would declare them. `tests` is
an installed app in the test settings, so workers may run these."""

import asyncio
import os
import time
from pathlib import Path

from telemachus.tasks_api import TaskContext, task


class Unlucky(Exception):
    """Raised on purpose: its dotted path must come back in the TaskResult's error."""


@task
def add(a: float, b: float) -> float:
    return a + b


@task
def fail(message: str) -> None:
    raise Unlucky(message)


@task(takes_context=True)
def introspect(context: TaskContext, tag: str) -> dict:
    """What a task learns from its context: its own result id, status and attempt."""
    result = context.task_result
    return {
        "id": result.id,
        "status": str(result.status),
        "attempt": context.attempt,
        "tag": tag,
        "workers": result.worker_ids,
    }


@task
async def double_later(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


@task
def nap(seconds: float, marker: str = "") -> dict:
    """Sleep, leaving a marker file first when asked (so a test knows the task runs), and say which
    process slept when (wall clock)."""
    if marker:
        Path(marker).write_text(str(os.getpid()))
    started = time.time()
    time.sleep(seconds)
    return {"pid": os.getpid(), "started": started, "finished": time.time()}


def not_a_task() -> None:
    """A plain function next to the tasks: a job naming it must not run it."""
