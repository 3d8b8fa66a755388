"""Flows' rounds that end with their quick tools (scheduler/flows/runner.py), written in batches
as results are: each round's end and its flow's requeue in one `rounds_end` with the other rounds
of this worker that end meanwhile, then one report to the breakers that their executors answered."""

import asyncio

from executors.health import DispatchReport
from scheduler.services.rounds import LeaseLost, RoundOutcome, rounds_end
from scheduler.worker.flight import Flight
from scheduler.worker.host import FlightHost

# The most flows' round ends one transaction writes.
ROUND_END_BATCH = 64


class RoundEnder:
    def __init__(self, host: FlightHost[Flight]) -> None:
        self.host = host
        self.ends: asyncio.Queue[tuple[RoundOutcome, asyncio.Future[str | None]]] = asyncio.Queue()

    async def round_end(self, end: RoundOutcome) -> str:
        """Write a flow's round's end and its requeue (`rounds_end`), batched with the other rounds
        of this worker that end meanwhile, and report to the breaker that its executor answered;
        returns the job's status. Raises LeaseLost when the write is refused (the lease no longer
        holds the job at that round)."""
        written: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        await self.ends.put((end, written))
        status = await written
        if status is None:
            raise LeaseLost(f"Lease {end.lease} no longer holds job {end.job_id} at round {end.round}.")
        return status

    async def run(self) -> None:
        while True:
            batch = [await self.ends.get()]
            while not self.ends.empty() and len(batch) < ROUND_END_BATCH:
                batch.append(self.ends.get_nowait())
            try:
                written = await self.host.db_retrying(
                    rounds_end, ends=[end for end, _ in batch], wake_others=self.host.wake_others
                )
            except Exception as exc:  # bad data, not an outage: each round's runner ends its job
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            answered = [
                DispatchReport(executor_id=f.claim.executor.pk, ok=True, executor_fault=False)
                for end, _ in batch
                if (f := self.host.flights.get(end.job_id)) is not None and f.claim.executor is not None
            ]
            for end, future in batch:
                if not future.done():
                    future.set_result(written.get(end.job_id))
            # The servers answered: one report for the batch, after the rounds' flights have ended
            # (so the worker claims first), in a transaction of its own.
            await self.host.dispatches_report(answered)
