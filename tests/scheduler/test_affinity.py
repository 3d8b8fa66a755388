"""Round affinity (QueuePolicy.affinity), in process: a flow's next round and a /v1/ session's
next call prefer the executor that served the last one, only among executors with a free slot,
never changing which job goes next; `affinity_wait_ms` holds a round back for its executor, and a
custom policy sees the preferred executor."""

from datetime import timedelta

import pytest

from scheduler.core.policy import FairSharePolicy
from scheduler.core.state import ExecutorView
from scheduler.models import Job, QueuePolicy, Slot
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.rounds import round_end, round_finish, round_requeue
from scheduler.services.submit import job_submit
from tests.scheduler.services.test_rounds import answer, calling, echoed, round_start, submit_flow

pytestmark = pytest.mark.django_db


def policy(**fields) -> QueuePolicy:
    record, _ = QueuePolicy.objects.update_or_create(pk=1, defaults=fields)
    return record


@pytest.fixture
def two_executors(member_setup, make_executor):
    """alice in team a; executors x and y (two slots each) offering model m, the shared one gone."""
    alice, *_, shared = member_setup
    shared.delete()
    return alice, make_executor("x", max_concurrency=2), make_executor("y", max_concurrency=2)


def claim_one(worker: str = "w"):
    (claim,) = job_claim(worker=worker, limit=1).claims
    return claim


def run_round(claim, n: int, *, quick: bool = False) -> None:
    """Round n of a flow (the claim started it): the model calls the echo tool, end (and requeue)."""
    start = round_start(claim)
    if quick:
        round_end(job_id=claim.job.pk, lease=claim.lease, round=start.round, message=calling(n), results=[echoed(n)])
        return
    round_finish(job_id=claim.job.pk, lease=claim.lease, round=start.round, message=calling(n))
    round_requeue(job_id=claim.job.pk, lease=claim.lease, round=start.round, results=[echoed(n)])


def chat(user, team: str = "a", **extra) -> Job:
    return job_submit(user=user, team=team, type="chat", requirements={"model": "m"}, input={"messages": []}, **extra)


def hold(executor, user) -> Slot:
    """A slot held on `executor` by a chat that never ends (as a busy model call would)."""
    job = chat(user)
    Job.objects.filter(pk=job.pk).update(
        status="running",
        lease="00000000-0000-0000-0000-000000000001",
        lease_expires_at=job.submitted_at + timedelta(hours=1),
        executor=executor,
    )
    return Slot.objects.create(
        job=job, executor=executor, team_id=job.team_id, user_id=job.user_id, worker="t", acquired_at=job.submitted_at
    )


@pytest.mark.parametrize("quick", [False, True])
def test_the_next_round_prefers_the_executor_of_the_last_one(two_executors, quick):
    # Given a flow whose first round ran on x, and x now the busier of the two (least-loaded
    # would pick y)...
    alice, x, y = two_executors
    flow = submit_flow(alice, prompt="go [rounds:4]")
    first = claim_one()
    assert first.executor.name == "x"
    hold(x, alice)
    run_round(first, 1, quick=quick)

    # When its next round is claimed, it goes back to x (affinity on: the default)...
    assert Job.objects.get(pk=flow.pk).affinity_executor_id == x.pk
    assert claim_one().executor.name == "x"


def test_with_affinity_off_the_rule_decides(two_executors):
    alice, x, y = two_executors
    policy(affinity="off")
    submit_flow(alice, prompt="go [rounds:4]")
    first = claim_one()
    hold(x, alice)
    run_round(first, 1)
    assert claim_one().executor.name == "y"


def test_a_full_preferred_executor_sends_the_round_elsewhere_at_once(two_executors):
    alice, x, y = two_executors
    submit_flow(alice, prompt="go [rounds:4]")
    first = claim_one()
    run_round(first, 1)
    hold(x, alice)
    hold(x, alice)  # x full

    again = claim_one()
    assert again.executor.name == "y"


def test_affinity_wait_holds_the_round_back_for_its_executor_then_gives_up(two_executors):
    # Given affinity_wait_ms of 30 s and the flow's executor full...
    alice, x, y = two_executors
    policy(affinity_wait_ms=30_000)
    submit_flow(alice, prompt="go [rounds:4]")
    run_round(claim_one(), 1)
    hold(x, alice)
    blocker = hold(x, alice)

    # When a worker claims, the round stays queued (y is free) and the claim says when to look again...
    batch = job_claim(worker="w", limit=4)
    assert batch.claims == [] and batch.backlog
    assert batch.wake_in is not None and 29 < batch.wake_in <= 30

    # ...x frees a slot: the round takes it.
    blocker.delete()
    assert claim_one().executor.name == "x"

    # And once its wait is over it goes elsewhere: rounds keep moving.
    other = submit_flow(alice, prompt="go [rounds:4]")
    Job.objects.filter(pk=other.pk).update(affinity_executor=x, queued_at=other.queued_at - timedelta(seconds=31))
    assert claim_one().executor.name == "y"


def test_affinity_never_changes_which_job_goes_next(two_executors):
    # Given one free slot in all (a global-scope order: a high-priority chat and a flow's round)...
    alice, x, y = two_executors
    submit_flow(alice, prompt="go [rounds:4]")
    run_round(claim_one(), 1)
    urgent = chat(alice, priority=5)
    # Then the chat still goes first: affinity only chooses where, never what.
    assert claim_one().job.pk == urgent.pk


def test_a_custom_policy_sees_the_preferred_executor(two_executors, settings):
    seen = {}

    class Recording(FairSharePolicy):
        def place(self, job: Job, candidates: list[ExecutorView]) -> ExecutorView | None:
            seen[job.pk] = (job.affinity_executor_id, self.preferred(job, candidates))
            return max(candidates, key=lambda v: v.executor.name)

    settings.TELEMACHUS_QUEUE_POLICY = f"{__name__}.RecordingPolicy"
    globals()["RecordingPolicy"] = Recording
    alice, x, y = two_executors
    flow = submit_flow(alice, prompt="go [rounds:4]")
    run_round(claim_one(), 1)
    claim = claim_one()
    assert claim.executor.name == "y"
    affinity, preferred = seen[flow.pk]
    assert affinity == y.pk and preferred.pk == y.pk


def test_a_session_prefers_the_executor_of_its_last_call(two_executors):
    # Given a session whose first call ran on x, and x now busier than y...
    alice, x, y = two_executors
    first = chat(alice, affinity_key="conversation-1")
    claim = claim_one()
    assert claim.executor.name == "x"
    job_finish(job_id=first.pk, lease=claim.lease, result={})
    hold(x, alice)

    # When the session's next call and a call of another session come...
    again = chat(alice, affinity_key="conversation-1")
    stranger = chat(alice, affinity_key="conversation-2")

    # Then the session's call goes to x, the other to the least loaded.
    assert again.affinity_executor_id == x.pk and stranger.affinity_executor_id is None
    placed = {c.job.pk: c.executor.name for c in job_claim(worker="w", limit=2).claims}
    assert placed == {again.pk: "x", stranger.pk: "y"}


def test_round_end_writes_the_end_and_the_requeue_at_once(two_executors):
    alice, x, y = two_executors
    flow = submit_flow(alice, prompt="go [rounds:2]")
    claim = claim_one()
    start = round_start(claim)
    status = round_end(job_id=flow.pk, lease=claim.lease, round=start.round, message=calling(1), results=[echoed(1)])
    job = Job.objects.get(pk=flow.pk)
    assert status == "queued" == job.status and job.rounds == 1 and not Slot.objects.exists()
    assert [m["role"] for m in job.conversation] == ["assistant", "tool"]
    events = list(job.events.order_by("id").values_list("event", flat=True))
    assert events[-2:] == ["round_finished", "queued"]

    # The last round: the model answers, the flow is done (no tools to record).
    claim = claim_one()
    start = round_start(claim)
    assert round_end(job_id=flow.pk, lease=claim.lease, round=start.round, message=answer(), results=[]) == "done"
    assert Job.objects.get(pk=flow.pk).result["rounds"] == 2


def test_the_policy_api_patches_affinity(api, operator, member_setup):
    client = api(operator)
    assert client.get("/api/policy/").json()["affinity"] == "prefer"
    response = client.patch("/api/policy/", {"affinity": "off", "affinity_wait_ms": 250}, format="json")
    assert response.status_code == 200
    record = QueuePolicy.objects.get()
    assert (record.affinity, record.affinity_wait_ms) == ("off", 250)
    assert client.patch("/api/policy/", {"affinity": "always"}, format="json").status_code == 400
    assert client.patch("/api/policy/", {"affinity_wait_ms": 60_001}, format="json").status_code == 400
