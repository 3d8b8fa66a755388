"""The flight host that a worker and an API process's one hop share (scheduler/worker/host.py), in
process against the test database: dispatches that end together are finished in one
`jobs_finish`; a result the database refuses fails its own job and no other; an aborted dispatch
leaves without a finish; a flight whose dispatch has ended is finished, never stopped."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from django.db import connection

from scheduler.connections import database_call, database_thread, database_thread_close
from scheduler.models import Job
from scheduler.services.claim import job_claim
from scheduler.services.finish import FinishReport, Outcome
from scheduler.services.submit import job_submit
from scheduler.worker.flight import Flight
from scheduler.worker.host import FlightHost

pytestmark = pytest.mark.django_db(transaction=True)


class Host(FlightHost[Flight]):
    """A host whose writes run on a thread of its own, and which remembers what it was told."""

    def __init__(self) -> None:
        super().__init__(name="host-test")
        self.thread = database_thread("host-test")
        self.batches: list[tuple[list[int], FinishReport | None]] = []
        self.left: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def held_db(self, fn: Callable[..., Any], /, **kwargs: Any) -> Any:
        await self.gate.wait()
        return await database_call(self.thread, fn, **kwargs)

    def finished(self, batch: list[tuple[Flight, Outcome]], report: FinishReport | None) -> None:
        self.batches.append(([outcome.job_id for _, outcome in batch], report))
        for flight, _ in batch:
            self.flights.pop(flight.job_id, None)

    def aborted(self, flight: Flight) -> None:
        self.left.append(flight.job_id)
        self.flights.pop(flight.job_id, None)


def claimed(member_setup, count: int) -> list:
    alice = member_setup[0]
    for _ in range(count):
        job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    claims = job_claim(worker="host-test", limit=count).claims
    assert len(claims) == count
    return claims


def answered(content: str) -> Callable[[Flight], Any]:
    async def dispatch(flight: Flight) -> Outcome:
        return Outcome(
            job_id=flight.job_id,
            lease=flight.claim.lease,
            ok=True,
            result={"message": {"role": "assistant", "content": content}},
            tokens_used=3,
        )

    return dispatch


def hosting(steps: Callable[[Host], Awaitable[None]]) -> Host:
    """Run `steps` with a new host on an event loop of its own; the host, once they are done."""

    async def run() -> Host:
        host = Host()
        try:
            await steps(host)
        finally:
            await database_thread_close(host.thread)
        return host

    return asyncio.run(run())


async def until(predicate: Callable[[], object], timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_dispatches_that_end_together_are_finished_in_one_write(member_setup):
    claims = claimed(member_setup, 3)

    async def steps(host: Host) -> None:
        # Given three flights whose dispatches all end at once...
        for claim in claims:
            host.fly(Flight(claim=claim), answered("hi"))
        # When the finisher writes them...
        await until(lambda: not host.flights)

    host = hosting(steps)
    # Then one jobs_finish wrote all three, each accepted and done.
    ((jobs, report),) = host.batches
    assert sorted(jobs) == sorted(claim.job.pk for claim in claims)
    assert report is not None and sorted(report.accepted) == sorted(jobs) and sorted(report.costs) == sorted(jobs)
    assert set(Job.objects.values_list("status", flat=True)) == {"done"}


def test_a_result_the_database_refuses_fails_its_own_job_only(member_setup):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite stores a NUL character; PostgreSQL's jsonb refuses it")
    good, bad = claimed(member_setup, 2)

    async def steps(host: Host) -> None:
        # Given two flights that end together, one with a reply PostgreSQL cannot store...
        host.fly(Flight(claim=good), answered("fine"))
        host.fly(Flight(claim=bad), answered("a\u0000b"))
        await until(lambda: not host.flights)

    host = hosting(steps)
    # Then the batch is written one by one: the good result is stored, the bad job fails with the
    # reason, and the one report says so for both (with the good one's cost).
    ((_, report),) = host.batches
    assert report is not None and sorted(report.accepted) == sorted([good.job.pk, bad.job.pk])
    assert good.job.pk in report.costs
    assert Job.objects.get(pk=good.job.pk).status == "done"
    failed = Job.objects.get(pk=bad.job.pk)
    assert failed.status == "failed" and "could not be stored" in failed.error


def test_an_aborted_dispatch_leaves_without_a_finish(member_setup):
    (claim,) = claimed(member_setup, 1)

    async def steps(host: Host) -> None:
        started = asyncio.Event()

        async def forever(flight: Flight) -> Outcome:
            started.set()
            await asyncio.Event().wait()
            raise AssertionError("never ends by itself")

        # Given a dispatch under way...
        host.fly(Flight(claim=claim), forever)
        await started.wait()
        # When its job is canceled...
        host.abort(claim.job.pk, "canceled")
        await until(lambda: not host.flights)

    host = hosting(steps)
    # Then it left through `aborted`, and nothing was finished for it.
    assert host.left == [claim.job.pk] and host.batches == []
    assert Job.objects.get(pk=claim.job.pk).status == "running"


def test_a_flight_whose_dispatch_ended_is_finished_not_stopped(member_setup):
    (claim,) = claimed(member_setup, 1)

    async def steps(host: Host) -> None:
        # Given a dispatch that ended while its finish waits for the database...
        host.gate.clear()
        flight = host.fly(Flight(claim=claim), answered("hi"))
        await until(lambda: flight.finishing)
        # When the flight is aborted meanwhile (its lease was thought lost, its call left)...
        host.abort(claim.job.pk, "lease lost")
        host.gate.set()
        await until(lambda: not host.flights)

    host = hosting(steps)
    # Then its finish is written all the same: the result is the lease holder's.
    assert host.left == [] and [jobs for jobs, _ in host.batches] == [[claim.job.pk]]
    assert Job.objects.get(pk=claim.job.pk).status == "done"
