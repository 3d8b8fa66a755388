"""The `cpu-node` executor: runs registered Python callables (executors/tasks.py) in a pool of
processes on the worker's host. It is the worked example of adding an executor kind
(docs/executors.md): the scheduler does not know this file exists.

A job of type `task` carries `input = {"callable": "<task name>", "args": [...], "kwargs": {...}}`.
Its result is `{"value": <the return value>, "task": <name>, "elapsed_s": <seconds in the call>}`,
with zero tokens. The value must be JSON (it becomes the job's result). The callable is a
registered task's name or the dotted path of a task declared with Django's tasks API (then
`input.backend` names the tasks backend alias that enqueued it). A task that raises fails its job
with `{"exception_class": "<dotted path>", "traceback": "..."}` as the job's result.

Capacity: each worker process keeps one process pool per cpu-node executor, created on the first
dispatch, with `max_concurrency` processes (the executor's own capacity), started on demand and
kept for later tasks. The scheduler never holds more slots on the executor than that, so a task
never waits inside the pool. Pool processes are started through a fork server, not forked from
the worker: forking a process that has threads (the worker's database thread) can copy a lock in
a held state into the child.

Cancel: a call running in a pool process cannot be interrupted, so the driver terminates and
rebuilds: cancelling a job whose task is running kills the processes of that pool, and the next
dispatch builds a new pool. Any other task that was running in the same pool at that moment (other
jobs on this executor, in this worker) starts again from the beginning in the new pool, within the
same attempt; a task must be safe to run again, as it already must be when a lost lease requeues
its job. The alternative, letting the task finish and discarding its result, would leave a slot's
worth of the executor busy for as long as the task runs (forever, for a runaway one) while the
scheduler counts that capacity as free.
"""

import asyncio
import functools
import inspect
import json
import logging
import multiprocessing
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from executors.contract import DispatchError, DispatchRequest, DispatchResult, ExecutorDriver
from executors.models import Executor
from executors.tasks import (
    TaskOutcome,
    UnknownTask,
    declared_task,
    declared_task_run,
    task_process_init,
    task_resolve,
    task_run,
)

log = logging.getLogger("telemachus.executors")

TASK_INPUT_SHAPE = '{"callable": "<task name>", "args": [...], "kwargs": {...}}'


class CpuNodeDriver(ExecutorDriver):
    kind = "cpu-node"
    chat = False
    tasks = True

    def __init__(self, executor: Executor) -> None:
        super().__init__(executor)
        self._pool: ProcessPoolExecutor | None = None
        # Pools this driver killed to stop a cancelled task: a call that breaks with one of them
        # was not at fault and runs again.
        self._killed: weakref.WeakSet[ProcessPoolExecutor] = weakref.WeakSet()
        self._calls: dict[int, tuple[ProcessPoolExecutor, Future]] = {}

    def pool(self) -> ProcessPoolExecutor:
        """The executor's process pool in this worker, created on first use."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=max(1, self.executor.max_concurrency),
                mp_context=multiprocessing.get_context("forkserver"),
                initializer=task_process_init,
            )
        return self._pool

    async def dispatch(self, request: DispatchRequest) -> DispatchResult:
        name, fn, args, kwargs = self._task_call(request)
        outcome = await self._run(request.job_id, fn, args, kwargs)
        if not outcome.ok:
            detail = None
            if outcome.traceback:
                # The task's failure, not the worker's: one line; the traceback is in the result.
                log.info("job %d: task %r raised %s", request.job_id, name, outcome.exception_class)
                detail = {"exception_class": outcome.exception_class, "traceback": outcome.traceback}
            raise DispatchError(f"task {name!r} {outcome.error}", retryable=False, detail=detail)
        return DispatchResult(
            output={"value": json.loads(outcome.value_json), "task": name, "elapsed_s": round(outcome.elapsed_s, 6)}
        )

    def _task_call(self, request: DispatchRequest) -> tuple[str, Callable[..., Any], list[Any], dict[str, Any]]:
        return task_call(request, kind=self.kind, executor_name=self.executor.name)

    async def _run(self, job_id: int, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> TaskOutcome:
        """Run the call in the pool, awaited without blocking the event loop."""
        while True:
            pool = self.pool()
            try:
                future = pool.submit(task_run, fn, args, kwargs)
                self._calls[job_id] = (pool, future)
                return await asyncio.wrap_future(future)
            except BrokenProcessPool as exc:
                if pool in self._killed:
                    log.info("job %d: its pool was stopped to cancel another job's task; running it again", job_id)
                    continue
                if pool is self._pool:
                    self._pool = None
                raise DispatchError(
                    f"{self.executor.name}: a pool process died while the task was running or queued ({exc})",
                    retryable=True,
                ) from exc
            finally:
                self._calls.pop(job_id, None)

    async def cancel(self, job_id: int) -> bool:
        """Abort the job's dispatch. A task still queued in the pool is dropped; a running one
        cannot be interrupted, so its pool's processes are killed (see the module docstring for
        what that means for other tasks in the same pool)."""
        aborted = await super().cancel(job_id)
        call = self._calls.get(job_id)
        if aborted and call is not None:
            pool, future = call
            if not future.cancel() and not future.done():
                self._kill(pool)
        return aborted

    def _kill(self, pool: ProcessPoolExecutor) -> None:
        if pool in self._killed:
            return
        self._killed.add(pool)
        if pool is self._pool:
            self._pool = None
        log.info("%s: killing a process pool to stop a cancelled task", self.executor.name)
        # Python 3.11 has no public way to stop a pool's processes (3.14 adds terminate_workers()).
        # Killing them makes the pool fail every call it holds with BrokenProcessPool, and _run
        # submits the calls of other jobs again to a new pool.
        for process in list((pool._processes or {}).values()):
            process.kill()
        pool.shutdown(wait=False)

    async def aclose(self) -> None:
        """Shut the pool down; its idle processes exit. The worker calls this once no dispatch is
        in flight (it stopped after draining, or the row changed and this driver went idle)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)


def task_call(
    request: DispatchRequest, *, kind: str, executor_name: str
) -> tuple[str, Callable[..., Any], list[Any], dict[str, Any]]:
    """The registered callable and its arguments, checked before anything is sent to a pool
    process (or, for an hpc-partition, to a batch job): every problem here is the job's (or
    the deployment's) and another attempt would meet it again, so none is retryable."""
    if request.type != "task":
        raise DispatchError(
            f"{executor_name} is a {kind} executor: it runs task jobs, not {request.type!r}", retryable=False
        )
    name = request.input.get("callable")
    args = request.input.get("args", [])
    kwargs = request.input.get("kwargs", {})
    if not isinstance(name, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise DispatchError(f"a task job's input must be {TASK_INPUT_SHAPE}", retryable=False)
    try:
        fn, target, leading = _task_target(request, name)
    except (UnknownTask, ImproperlyConfigured) as exc:
        raise DispatchError(str(exc), retryable=False) from exc
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        signature = None  # some builtins have none; a bad call then fails inside the task
    if signature is not None:
        try:
            signature.bind(*leading, *args, **kwargs)
        except TypeError as exc:
            raise DispatchError(f"bad arguments for task {name!r}: {exc}", retryable=False) from exc
    return name, fn, args, kwargs


def _task_target(request: DispatchRequest, name: str) -> tuple[Callable[..., Any], Callable[..., Any], tuple]:
    """What to send to the pool, the function whose signature the arguments must fit, and the
    arguments the call adds before the job's own (a declared task's context)."""
    try:
        fn = task_resolve(name=name)
    except UnknownTask:
        declared = declared_task(path=name)
        if declared is None:
            raise
        backend = request.input.get("backend", declared.backend)
        if not isinstance(backend, str):
            raise UnknownTask(f"a task job's input.backend must be a tasks backend alias, not {backend!r}") from None
        call = functools.partial(declared_task_run, name, backend, str(request.job_id))
        return call, declared.func, (None,) if declared.takes_context else ()
    return fn, fn, ()
