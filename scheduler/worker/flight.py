"""What a worker keeps of one claimed job while it runs: shared by the worker's dispatch and a
flow's round (scheduler/flows/runner.py), which runs on the same flight."""

import asyncio
from dataclasses import dataclass

from executors.contract import ExecutorDriver
from scheduler.services.claim import Claim


@dataclass
class InFlight:
    claim: Claim
    driver: ExecutorDriver | None
    task: asyncio.Task[None] | None = None
    renewed_at: float = 0.0
    started: float = 0.0
    abort_reason: str | None = None  # "canceled" | "lease lost" | "shutdown"
    executor_fault: bool = False
