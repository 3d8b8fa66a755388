"""Round affinity with real worker processes and two real HTTP model servers (simllm) on
PostgreSQL: a flow's rounds stay on the executor that served its first one while it has room,
and go elsewhere at once (or after `affinity_wait_ms`) when it is full."""

import uuid
from collections import Counter
from datetime import timedelta
from pprint import pformat

import pytest
from django.db import transaction

from executors.models import Executor
from scheduler.core.locks import lock_claim
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.submit import job_submit
from tests.concurrency.test_flows import submit_flow
from tests.processes import http_json, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def two_servers(processes, member_setup):
    """Executors x and y, each a simllm of its own, offering model m (the sim executor disabled)."""

    def start(*, latency_ms: float, max_concurrency: int) -> dict[str, tuple[str, Executor]]:
        Executor.objects.filter(name="shared").update(enabled=False)
        servers = {}
        for name in ("x", "y"):
            base = processes.simllm(latency_ms=latency_ms)
            executor = Executor.objects.create(
                name=name,
                kind="local-model",
                endpoint=f"{base}/v1",
                capabilities={"models": ["m"]},
                max_concurrency=max_concurrency,
            )
            servers[name] = (base, executor)
        return servers

    return start


def served(servers: dict[str, tuple[str, Executor]], job: Job) -> Counter:
    """How many model calls of the job each server answered (simllm's own count)."""
    return Counter(
        {name: http_json(f"{base}/stats")["jobs"].get(str(job.pk), 0) for name, (base, _) in servers.items()}
    )


def round_executors(job: Job) -> dict[int, int]:
    """Round number -> the executor its `round_started` event names."""
    return dict(JobEvent.objects.filter(job=job, event="round_started").values_list("meta__round", "executor_id"))


def story(job: Job) -> list[tuple]:
    """The job's events in order: what each was, on which executor, when, and its details."""
    return list(JobEvent.objects.filter(job=job).order_by("id").values_list("event", "executor_id", "at", "meta"))


def round_waits(job: Job) -> dict[int, float]:
    """Round number -> seconds from its `queued` event (the previous round's requeue) to its start."""
    waits, queued = {}, None
    for event in JobEvent.objects.filter(job=job).order_by("id"):
        if event.event == "queued" and "round" in event.meta:
            queued = event
        elif event.event == "started" and queued is not None:
            waits[queued.meta["round"]] = (event.at - queued.at).total_seconds()
            queued = None
    return waits


def test_with_room_a_flows_rounds_stay_on_one_executor(processes, member_setup, two_servers):
    # Given two model servers of four slots each and six 20-round flows sharing them (more flows
    # than one server has slots, so both serve), affinity on...
    alice = member_setup[0]
    QueuePolicy.objects.update_or_create(pk=1, defaults={"affinity": "prefer"})
    servers = two_servers(latency_ms=100, max_concurrency=4)
    flows = [submit_flow(alice, 20) for _ in range(6)]
    processes.worker("w1", concurrency=8)
    processes.worker("w2", concurrency=8)

    # When they run to the end...
    ids = [flow.pk for flow in flows]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status="done").count() == len(ids),
        timeout=180,
        interval=0.2,
        what="the flows done",
    )

    # Then both servers served, and each flow made at least 95% of its model calls on one of
    # them. (Without affinity, whether rounds wander depends on timing: seen both ways, so it is
    # no control here; tests/scheduler/test_affinity.py checks placement with affinity off and on
    # deterministically.)
    shares, per_server = [], Counter()
    for flow in flows:
        calls = served(servers, flow)
        assert sum(calls.values()) == 20
        shares.append(max(calls.values()) / 20)
        per_server.update(calls)
    # (On failure, in full: each flow that moved, its events in order (a retry goes elsewhere),
    # and what the executors went through meanwhile: health or breaker changes take an executor
    # out of placement, which is not "room".)
    assert min(shares) >= 0.95, pformat(
        {
            "shares": shares,
            "moved": {flow.pk: story(flow) for flow, share in zip(flows, shares, strict=True) if share < 0.95},
            "executors": list(JobEvent.objects.filter(job__isnull=True).values_list("executor__name", "event", "meta")),
        },
        width=160,
    )
    assert len(+per_server) == 2, per_server
    assert not Slot.objects.exists()


def fill(executor: Executor, flow: Job, user) -> None:
    """Fill the executor's one slot with a chat that never ends, between two of the flow's rounds:
    under the claim lock (no round can start meanwhile), once the round running there has ended."""
    with transaction.atomic():
        lock_claim()
        wait_until(lambda: not Slot.objects.filter(executor=executor).exists(), timeout=10, what="the round's end")
        blocker = job_submit(user=user, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
        now = Job.objects.get(pk=blocker.pk).submitted_at
        Job.objects.filter(pk=blocker.pk).update(
            status="running",
            executor=executor,
            worker="blocker",
            lease=uuid.uuid4(),
            lease_expires_at=now + timedelta(hours=1),
        )
        Slot.objects.create(
            job=blocker, executor=executor, team_id=blocker.team_id, user_id=user.pk, worker="blocker", acquired_at=now
        )


@pytest.mark.parametrize("wait_ms", [0, 2000])
def test_with_its_executor_full_the_round_goes_elsewhere(processes, member_setup, two_servers, wait_ms):
    # Given a 10-round flow on one of two one-slot executors...
    alice = member_setup[0]
    QueuePolicy.objects.update_or_create(pk=1, defaults={"affinity_wait_ms": wait_ms})
    servers = two_servers(latency_ms=150, max_concurrency=1)
    flow = submit_flow(alice, 10)
    processes.worker("w1", concurrency=8)
    processes.worker("w2", concurrency=8)
    wait_until(lambda: Job.objects.get(pk=flow.pk).rounds >= 2, timeout=30, what="two rounds")
    home = Executor.objects.get(pk=round_executors(flow)[1])

    # When that executor's slot is taken by other work between two rounds...
    fill(home, flow, alice)
    wait_until(lambda: Job.objects.get(pk=flow.pk).status == "done", timeout=60, interval=0.1, what="the flow done")

    # Then the rounds after it ran on the other executor: at once by default, after the wait with
    # affinity_wait_ms; and the full executor never took a round beyond its slot.
    rounds = round_executors(flow)
    before = max(r for r, e in rounds.items() if e == home.pk)
    moved = {r: e for r, e in rounds.items() if r > before}
    assert moved and set(moved.values()) == {Executor.objects.exclude(pk=home.pk).get(name__in=["x", "y"]).pk}
    first_moved = min(moved)
    waits = round_waits(flow)
    if wait_ms:
        assert waits[first_moved] >= wait_ms / 1000 - 0.05, waits
    else:
        assert waits[first_moved] < 0.5, waits
    # Every later round stays on its new executor, with no wait.
    assert all(waits[r] < 0.5 for r in moved if r != first_moved), waits
    calls = served(servers, flow)
    assert sum(calls.values()) == 10
