"""From an executor's `kind` to its driver class, and one driver instance per executor row.

Built-in kinds are listed here; a deployment adds kinds without touching the scheduler through
TELEMACHUS_EXECUTOR_DRIVERS = "kind=dotted.path.Class,..."."""

import json
from functools import cache

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from executors.contract import ExecutorDriver
from executors.models import Executor

BUILTIN_DRIVERS = {
    "sim": "executors.drivers.sim.SimDriver",
    "local-model": "executors.drivers.openai.LocalModelDriver",
    "remote-model": "executors.drivers.openai.RemoteModelDriver",
    "cpu-node": "executors.drivers.cpu.CpuNodeDriver",
    "hpc-partition": "executors.drivers.slurm.SlurmPartitionDriver",
}


@cache
def driver_paths() -> dict[str, str]:
    paths = dict(BUILTIN_DRIVERS)
    for entry in settings.TELEMACHUS_EXECUTOR_DRIVERS:
        kind, sep, path = entry.partition("=")
        if not sep or not kind.strip() or not path.strip():
            raise ImproperlyConfigured(f"TELEMACHUS_EXECUTOR_DRIVERS entry {entry!r} is not kind=dotted.path")
        paths[kind.strip()] = path.strip()
    return paths


def known_kinds() -> list[str]:
    return sorted(driver_paths())


@cache
def driver_class(kind: str) -> type[ExecutorDriver]:
    """The driver class for a kind, imported on first use."""
    try:
        path = driver_paths()[kind]
    except KeyError:
        raise ImproperlyConfigured(f"No driver registered for executor kind {kind!r}") from None
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"driver {path} (executor kind {kind!r}) cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, ExecutorDriver)):
        raise ImproperlyConfigured(f"{path} (executor kind {kind!r}) is not an ExecutorDriver")
    return cls


def kind_chats(kind: str) -> bool:
    """Whether executors of this kind answer model calls (ExecutorDriver.chat). A kind whose driver
    this process cannot import is taken at its word: the worker that dispatches to it fails the
    job with the reason, which is more use than "unknown model"."""
    try:
        return driver_class(kind).chat
    except ImproperlyConfigured:
        return True


def kind_runs_tasks(kind: str) -> bool:
    """Whether executors of this kind run task jobs (ExecutorDriver.tasks). A kind whose driver
    this process cannot import is taken at its word, as by `kind_chats`."""
    try:
        return driver_class(kind).tasks
    except ImproperlyConfigured:
        return True


def driver_for(executor: Executor) -> ExecutorDriver:
    """A fresh driver for one-off use outside a worker (probes from the API, capability sync)."""
    return driver_class(executor.kind)(executor)


class DriverPool:
    """One driver per executor row, rebuilt when its configuration changes (an operator edited the
    endpoint, capacity, transport or meta, by any means), so connection and process pools are
    reused across dispatches and sized to the executor. Owned by one worker process."""

    def __init__(self) -> None:
        self._drivers: dict[int, tuple[object, ExecutorDriver]] = {}

    def get(self, executor: Executor) -> tuple[ExecutorDriver, ExecutorDriver | None]:
        """The driver for this version of the row, and the replaced driver (to close) if any."""
        version = (
            executor.kind,
            executor.endpoint,
            executor.max_concurrency,
            json.dumps([executor.transport, executor.meta], sort_keys=True),
        )
        cached = self._drivers.get(executor.pk)
        if cached is not None and cached[0] == version:
            return cached[1], None
        driver = driver_class(executor.kind)(executor)
        self._drivers[executor.pk] = (version, driver)
        return driver, cached[1] if cached is not None else None

    def all(self) -> list[ExecutorDriver]:
        return [driver for _, driver in self._drivers.values()]
