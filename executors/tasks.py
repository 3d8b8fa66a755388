"""The tasks a `cpu-node` executor may run, by name.

A `task` job names what to run (`input.callable`), never a code path: only callables registered
here run, so submitting a job cannot make a worker import arbitrary code. Three honest demo tasks
are built in; a deployment adds its own with TELEMACHUS_TASKS = "name=dotted.path.function,..."
(an entry may also replace a built-in name). The registry is read from settings on every lookup:
it is a handful of entries and Python caches the imports, so there is no cache to go stale when
the setting changes.

A job may also name a task declared with Django's tasks API (`@task`, scheduler/tasks_backend.py)
by its dotted path: `declared_task` accepts only a Task object in a module of an installed app.

This module is also the first thing a pool process imports (`task_process_init`, `task_run`), so
it must stay importable before Django is set up: no models at import time.
"""

import hashlib
import json
import multiprocessing
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import django
from django.apps import apps
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections
from django.utils.module_loading import import_string

from telemachus.tasks_api import Task, TaskContext, task_backends

BUILTIN_TASKS = {
    "telemachus.add": "executors.tasks.add",
    "telemachus.sha256": "executors.tasks.sha256",
    "telemachus.sleep": "executors.tasks.sleep",
}


class UnknownTask(LookupError):
    """A job named a task that nobody registered."""


# --- built-in tasks ---------------------------------------------------------------------------


def add(*numbers: float) -> float:
    """The sum of the numbers: the smallest useful task, for demos and for timing the round trip
    through a pool process."""
    for number in numbers:
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise TypeError(f"add takes numbers, not {type(number).__name__}")
    return sum(numbers)


def sha256(text: str, rounds: int = 1) -> str:
    """The hex SHA-256 of `text`, hashed `rounds` times over (each round hashes the previous
    digest): CPU-bound work whose cost the caller sets, for demos and capacity planning."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, not {type(text).__name__}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, not {rounds!r}")
    digest = text.encode()
    for _ in range(rounds):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()


def sleep(seconds: float) -> dict[str, float | int]:
    """Sleep, then say which process slept and when (wall clock, seconds since the epoch): lets
    tests and demos see capacity (how many ran at once) and cancel (a long sleep to stop)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ValueError(f"seconds must be a non-negative number, not {seconds!r}")
    started = time.time()
    time.sleep(seconds)
    return {"pid": os.getpid(), "started": started, "finished": time.time()}


# --- the registry -----------------------------------------------------------------------------


def task_paths() -> dict[str, str]:
    """Task name -> dotted path: the built-ins, then TELEMACHUS_TASKS in order."""
    paths = dict(BUILTIN_TASKS)
    for entry in settings.TELEMACHUS_TASKS:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ImproperlyConfigured(f"TELEMACHUS_TASKS entry {entry!r} is not name=dotted.path.function")
        paths[name.strip()] = path.strip()
    return paths


def task_resolve(*, name: str) -> Callable[..., Any]:
    """The callable registered as `name`.

    Raises UnknownTask for a name nobody registered (the job's fault), ImproperlyConfigured for a
    broken registration (the deployment's fault): a path that does not import, something that is
    not callable, or a callable a pool process could not find by name (a lambda, a closure)."""
    paths = task_paths()
    try:
        path = paths[name]
    except KeyError:
        raise UnknownTask(f"unknown task {name!r}; registered tasks: {', '.join(sorted(paths))}") from None
    try:
        fn = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"task {name!r}: cannot import {path}: {exc}") from exc
    if not callable(fn):
        raise ImproperlyConfigured(f"task {name!r}: {path} is not callable")
    try:
        # A callable reaches a pool process pickled by reference (module and name); this fails for
        # exactly the callables that could not be found there.
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ImproperlyConfigured(
            f"task {name!r}: {path} cannot be sent to a pool process; register a module-level function ({exc})"
        ) from exc
    return fn


# --- tasks declared with Django's tasks API -------------------------------------------------------


def declared_task(*, path: str) -> Task | None:
    """The Django task declared (`@task`) at `path` ("reports.tasks.summarize"), or None when `path`
    is not inside an installed app.

    A job names such a task by its dotted path, so finding it imports code: only a module of an
    installed app is imported (checked by name, before anything is imported), and only a Task
    object is accepted, so a job cannot make a worker import or call anything else. Raises
    UnknownTask for a path inside an installed app that does not lead to a Task."""
    module, _, _ = path.rpartition(".")
    if not module or apps.get_containing_app_config(module) is None:
        return None
    try:
        found = import_string(path)
    except ImportError as exc:
        raise UnknownTask(f"cannot import task {path}: {exc}") from exc
    if not isinstance(found, Task):
        raise UnknownTask(f"{path} is not a task declared with Django's @task")
    return found


def declared_task_run(path: str, backend: str, result_id: str, /, *args: Any, **kwargs: Any) -> Any:
    """Call a declared task in a pool process. A task that takes context gets a TaskContext whose
    `task_result` is what the backend's `get_result(result_id)` reports (the job is running, on
    its current attempt). Database connections the call opened are closed after it, as after a
    request."""
    task = declared_task(path=path)
    if task is None:
        raise UnknownTask(f"{path} is not in an installed app")
    try:
        if task.takes_context:
            context = TaskContext(task_result=task_backends[backend].get_result(result_id))
            return task.call(context, *args, **kwargs)
        return task.call(*args, **kwargs)
    finally:
        close_old_connections()


# --- inside a pool process --------------------------------------------------------------------


@dataclass(frozen=True)
class TaskOutcome:
    """What a pool process sends back for one call. Never an exception object (a custom exception
    may not unpickle in the worker) and never a raw value: the value travels as the JSON text that
    the job's result will hold, so what the driver returns is exactly what gets stored."""

    ok: bool
    value_json: str = ""
    error: str = ""
    # The dotted path of the exception's class ("builtins.ValueError"), when the task raised.
    exception_class: str = ""
    traceback: str = ""
    elapsed_s: float = 0.0


def task_process_init() -> None:
    """Prepare a fresh pool process. Ctrl-C reaches the whole process group, but what it means is
    the worker's decision (the first drains, the second aborts), so a pool process ignores SIGINT
    rather than die under a drain. It exits when its worker dies (see `_exit_with_worker`). Django
    is set up (from the inherited DJANGO_SETTINGS_MODULE) so a deployment's tasks may import
    models and settings."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_worker, name="exit-with-worker", daemon=True).start()
    django.setup()


def _exit_with_worker() -> None:
    """Nothing tells a pool process that its worker was killed (SIGKILL, the OOM killer): it would
    wait for calls forever, and keep its fork server alive. The worker holds the write end of a
    pipe to each pool process (multiprocessing's parent sentinel), which closes when the worker
    dies, however it dies; a running task is abandoned with it (its lease expires and recovery
    requeues the job)."""
    parent = multiprocessing.parent_process()
    assert parent is not None, "runs only in a pool process"
    parent.join()
    os._exit(1)


def task_run(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> TaskOutcome:
    """Call a task and report how it went. Runs in a pool process."""
    started = time.perf_counter()
    try:
        value = fn(*args, **kwargs)
    except (Exception, SystemExit) as exc:
        return TaskOutcome(
            ok=False,
            error=f"raised {type(exc).__name__}: {exc}",
            exception_class=f"{type(exc).__module__}.{type(exc).__qualname__}",
            traceback=traceback.format_exc(),
            elapsed_s=time.perf_counter() - started,
        )
    elapsed = time.perf_counter() - started
    try:
        # allow_nan=False: NaN and Infinity are not JSON, and PostgreSQL's jsonb refuses them.
        value_json = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return TaskOutcome(ok=False, error=f"returned a value that is not JSON-serialisable: {exc}", elapsed_s=elapsed)
    return TaskOutcome(ok=True, value_json=value_json, elapsed_s=elapsed)
