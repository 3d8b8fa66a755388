"""The Executor contract: the only thing the scheduler knows about where work runs.

A driver wraps one `Executor` row. What the design's contract calls `capabilities()`, `health()` and
`capacity()` are that row's fields (`capabilities`, `health`, `max_concurrency`), which the scheduler
reads straight from the table for placement, kept current by `list_models()` (capability sync) and
`probe()`; the slots in use are the scheduler's own rows, counted by the claim at every scope. The
worker calls `execute()` (which runs the driver's `dispatch()`, or
`stream()` for a streamed job) outside any database transaction, `cancel()` when the job is canceled
or its lease is lost, and `probe()` periodically to keep `health` current. Adding a kind of executor
means writing a driver and registering it (executors/registry.py); the scheduler never changes.
See docs/executors.md."""

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from executors.models import Executor

# The model APIs a step may call (`requirements.api`); an executor that serves embeddings says so
# with `capabilities.embeddings: true`.
CHAT_API, EMBEDDINGS_API = "chat", "embeddings"


@dataclass(frozen=True)
class DispatchRequest:
    """What a driver needs to run one step of a job; built by the worker from the job row."""

    job_id: int
    type: str
    model: str
    input: dict[str, Any]
    requirements: dict[str, Any] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return bool(self.input.get("stream"))

    @property
    def api(self) -> str:
        """Which model API the step calls: `chat` (completions) or `embeddings`."""
        return self.requirements.get("api") or CHAT_API


@dataclass
class DispatchResult:
    output: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def tokens_used(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def stored_output(self) -> dict[str, Any]:
        """The output as the job's `result` keeps it: with the step's token usage when there was
        any, so whoever reads the result (the OpenAI-compatible endpoint) can report it."""
        if not self.tokens_used:
            return self.output
        return {
            **self.output,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.tokens_used,
            },
        }


@dataclass(frozen=True)
class StreamEvent:
    """One event of a streamed dispatch: deltas, then exactly one `done` with the result. A
    `delta` is a piece of the reply's text; a `tool` delta a piece of the arguments of its tool
    call `index`, with the call's id and function name as far as they are known, so that apps
    see a tool call as the model writes it."""

    kind: str  # "delta" | "tool" | "done"
    text: str = ""
    result: DispatchResult | None = None
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Probe:
    """What an active health check saw. `models` is what the executor reports serving, if it can."""

    health: str  # Executor.Health value
    latency_ms: float | None = None
    models: list[str] | None = None
    detail: str = ""


class DispatchError(Exception):
    """A dispatch that failed. `retryable` tells the worker whether another attempt (possibly on
    another executor) could succeed; `executor_fault` whether the failure counts against the
    executor's circuit breaker (connection refused or reset, timeout, 5xx); `timed_out` whether the
    executor did not answer in time; the message is what the job's `error` shows. `detail`, when
    given, is stored as the failed job's `result` (a task's exception class and traceback, for the
    tasks API)."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
        executor_fault: bool | None = None,
        detail: dict[str, Any] | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.detail = detail
        self.status = status
        self.retry_after = retry_after
        self.timed_out = timed_out
        self.executor_fault = retryable and status != 429 if executor_fault is None else executor_fault


class DeltaSink(Protocol):
    """Where a streamed dispatch's deltas go (the worker's relay to the API processes): text, or
    with `tool` = (index, id, name), a piece of that tool call's arguments."""

    async def __call__(self, text: str, *, tool: tuple[int, str, str] | None = None) -> None: ...


# Where a driver's `report_step` goes: the worker records each report as a `step` event of the job
# (a batch system's job id, say), so an operator can find the remote work from the job's events.
StepSink = Callable[[dict[str, Any]], Awaitable[None]]


class ExecutorDriver(ABC):
    kind: ClassVar[str]
    # Whether it answers model calls (chat, translate, flow rounds, embeddings). The models a
    # driver that does not (cpu-node: task jobs only) lists in `capabilities.models` name its
    # task queues, not chat models: the OpenAI-compatible endpoint neither lists nor accepts them.
    chat: ClassVar[bool] = True
    # Whether it runs task jobs (`input = {"callable", "args", "kwargs"}`: cpu-node, a batch
    # system). A task job goes only to such a kind; a model server would take its input for a
    # chat completion.
    tasks: ClassVar[bool] = False

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._inflight: dict[int, asyncio.Task[Any]] = {}
        self._step_sinks: dict[int, StepSink] = {}

    @abstractmethod
    async def dispatch(self, request: DispatchRequest) -> DispatchResult:
        """Run one step. Raise DispatchError on failure; never touch the database."""

    async def stream(self, request: DispatchRequest) -> AsyncIterator[StreamEvent]:
        """Run one step as a stream of events. Drivers that cannot stream send the whole result
        as one delta; HTTP model drivers override this to relay the server's own stream."""
        result = await self.dispatch(request)
        text = (result.output.get("message") or {}).get("content") or ""
        if text:
            yield StreamEvent(kind="delta", text=text)
        yield StreamEvent(kind="done", result=result)

    async def list_models(self) -> list[str] | None:
        """The models the executor reports serving, for capability sync; None when this kind does
        not report them (its capabilities are configured by the operator)."""
        return None

    async def probe(self) -> Probe:
        """An active health check. In-process drivers are as healthy as the worker running them."""
        return Probe(health=Executor.Health.OK)

    async def execute(
        self, request: DispatchRequest, on_delta: DeltaSink | None = None, on_step: StepSink | None = None
    ) -> DispatchResult:
        """Run `dispatch` (or `stream`, for a streamed job) as a cancellable unit: `cancel(job_id)`
        aborts it from another task, closing any HTTP request it has open. `on_step` receives what
        the dispatch reports through `report_step`."""
        task = asyncio.current_task()
        assert task is not None
        self._inflight[request.job_id] = task
        if on_step is not None:
            self._step_sinks[request.job_id] = on_step
        try:
            if not request.stream:
                return await self.dispatch(request)
            async for event in self.stream(request):
                if event.kind == "delta" and on_delta is not None:
                    await on_delta(event.text)
                elif event.kind == "tool" and on_delta is not None:
                    await on_delta(event.text, tool=(event.index, event.id, event.name))
                elif event.kind == "done" and event.result is not None:
                    return event.result
            raise DispatchError(f"{self.executor.name}: stream ended without a result", retryable=True)
        finally:
            self._inflight.pop(request.job_id, None)
            self._step_sinks.pop(request.job_id, None)

    async def report_step(self, job_id: int, **meta: Any) -> None:
        """Tell whoever runs the dispatch of `job_id` about a step worth a job event (the worker
        records it as `step` with this meta; say `action=...`). Drivers never touch the database,
        so this is their only way into a job's events. Nothing happens when nobody listens (a
        direct `dispatch()` call, a test), and a sink that fails does not fail the dispatch."""
        sink = self._step_sinks.get(job_id)
        if sink is None:
            return
        try:
            await sink(meta)
        except Exception:  # the event is for observability; the work goes on without it
            logging.getLogger("telemachus.executors").exception("job %d: step report %s not recorded", job_id, meta)

    async def cancel(self, job_id: int) -> bool:
        """Abort the in-flight dispatch of a job, if this driver is running one. Drivers with
        remote state (a batch system, a pod) override this to clean up there too."""
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
