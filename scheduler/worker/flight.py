"""What a process keeps of one claimed job while it runs it: a flight of a worker (its dispatch, a
flow's round: scheduler/flows/runner.py) or of an API process that runs the call it holds
(scheduler/gateway/onehop.py). Its host (scheduler/worker/host.py) heartbeats, finishes and aborts
it."""

import asyncio
from dataclasses import dataclass

from executors.contract import ExecutorDriver
from scheduler.services.claim import Claim


@dataclass
class Flight:
    claim: Claim
    driver: ExecutorDriver | None = None
    task: asyncio.Task[None] | None = None
    renewed_at: float = 0.0  # time.monotonic() of the last heartbeat that renewed its lease
    started: float = 0.0
    abort_reason: str | None = None  # "canceled" | "lease lost" | "shutdown" | "its call ended"
    executor_fault: bool = False  # its dispatch failed by the executor's fault (for the breaker)
    finishing: bool = False  # its dispatch has ended and its outcome is with the finisher

    @property
    def job_id(self) -> int:
        return self.claim.job.pk
