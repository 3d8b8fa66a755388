"""The Executor contract: the only thing the scheduler knows about where work runs.

A driver wraps one `Executor` row. The scheduler reads `capabilities()` and `health()` for placement
and `capacity()` for display; the worker calls `execute()` (which runs the driver's `dispatch()`)
outside any database transaction, and `cancel()` when the job is canceled or its lease is lost.
Adding a kind of executor means writing a driver and registering it (executors/registry.py); the
scheduler never changes. See docs/executors.md."""

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from executors.models import Executor
from executors.selectors import Capacity, executor_capacity


@dataclass(frozen=True)
class DispatchRequest:
    """What a driver needs to run one step of a job; built by the worker from the job row."""

    job_id: int
    type: str
    model: str
    input: dict[str, Any]
    requirements: dict[str, Any] = field(default_factory=dict)


@dataclass
class DispatchResult:
    output: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens_used(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class DispatchError(Exception):
    """A dispatch that failed. `retryable` tells the worker whether another attempt (possibly on
    another executor) could succeed; the message is what the job's `error` shows."""

    def __init__(self, message: str, *, retryable: bool, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after


class ExecutorDriver(ABC):
    kind: ClassVar[str]

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._inflight: dict[int, asyncio.Task] = {}

    def capabilities(self) -> dict[str, Any]:
        return dict(self.executor.capabilities)

    def capacity(self) -> Capacity:
        return executor_capacity(executor=self.executor)

    def health(self) -> str:
        """The health last recorded for the executor (probes update it; see the executors issue)."""
        return self.executor.health

    @abstractmethod
    async def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Run one step. Raise DispatchError on failure; never touch the database."""

    async def execute(self, request: DispatchRequest) -> DispatchResult:
        """Run `dispatch` as a cancellable unit: `cancel(job_id)` aborts it from another task."""
        task = asyncio.current_task()
        assert task is not None
        self._inflight[request.job_id] = task
        try:
            return await self.dispatch(request)
        finally:
            self._inflight.pop(request.job_id, None)

    async def cancel(self, job_id: int) -> bool:
        """Abort the in-flight dispatch of a job, if this driver is running one. Cancelling the task
        closes any HTTP request it has open. Drivers with remote state override this to clean up."""
        task = self._inflight.get(job_id)
        if task is None or task.done():
            return False
        task.cancel()
        return True

    @property
    def busy(self) -> bool:
        """True while a dispatch is in flight."""
        return bool(self._inflight)

    async def aclose(self) -> None:
        """Release pooled resources (connections) when the worker stops or the row changes."""
