"""Rounds of a flow, in process: begin, finish, tools, requeue; fencing, billing, order, crashes."""

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from executors.tools import ToolOutcome
from quotas.models import QuotaPolicy, Usage
from scheduler.live.snapshot import dashboard_state
from scheduler.models import Job, JobEvent, QueuePolicy, Slot, TeamShare
from scheduler.services.claim import Claim, job_claim
from scheduler.services.finish import Outcome, jobs_finish
from scheduler.services.recover import jobs_recover
from scheduler.services.requeue import job_requeue
from scheduler.services.rounds import (
    LeaseLost,
    RoundOutcome,
    RoundStart,
    round_begin,
    round_claimed,
    round_end,
    round_finish,
    round_requeue,
    round_tool_record,
    rounds_end,
)
from scheduler.services.submit import job_submit
from telemachus.control.features import feature_set

pytestmark = pytest.mark.django_db


def submit_flow(user, team="a", *, prompt="go [rounds:3]", tools=("echo",), **input_extra) -> Job:
    return job_submit(
        user=user,
        team=team,
        type="flow",
        requirements={"model": "m", "est_tokens": 10},
        input={"messages": [{"role": "user", "content": prompt}], "tools": list(tools), **input_extra},
    )


def calling(n: int, tool: str = "echo") -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{n}", "type": "function", "function": {"name": tool, "arguments": json.dumps({"round": n})}}
        ],
    }


def answer(text: str = "done") -> dict:
    return {"role": "assistant", "content": text}


def echoed(n: int, ok: bool = True) -> ToolOutcome:
    content = json.dumps({"round": n}) if ok else "tool 'echo' raised ValueError: no"
    return ToolOutcome(name="echo", call_id=f"call_{n}", ok=ok, content=content, seconds=0.01)


def claim_one(worker="w"):
    (claim,) = job_claim(worker=worker, limit=1).claims
    return claim


def round_start(claim: Claim) -> RoundStart:
    """The round a claim of the flow starts, as the worker takes it: the claim started it
    (`round_claimed`), unless the last round's tool calls have no results yet (`round_begin`)."""
    return round_claimed(claim.job) or round_begin(job_id=claim.job.pk, lease=claim.lease)


def expire(job_id: int) -> None:
    Job.objects.filter(pk=job_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


class TestOneRound:
    def test_round_with_tool_calls_frees_the_slot_bills_and_waits_for_tools(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()

        start = round_start(claim)
        assert start.round == 1 and start.pending == []
        assert JobEvent.objects.filter(job=flow, event="round_started").count() == 1, "the claim's, once"
        assert start.messages == [{"role": "user", "content": "go [rounds:3]"}]

        end = round_finish(
            job_id=flow.pk, lease=claim.lease, round=1, message=calling(1), prompt_tokens=6, completion_tokens=4
        )
        assert end.tools_to_run and end.tool_calls == calling(1)["tool_calls"]
        job = Job.objects.get(pk=flow.pk)
        # Still held (its lease, for the tools) but no slot, no reservation: capacity is free.
        assert (job.status, job.lease, job.rounds, job.tokens_used) == ("running", claim.lease, 1, 10)
        assert not Slot.objects.exists() and job.reservation is None
        finished = JobEvent.objects.get(job=job, event="round_finished")
        assert finished.meta | {"seconds": None} == {
            "round": 1,
            "tokens": 10,
            "prompt_tokens": 6,
            "completion_tokens": 4,
            "tools": ["echo"],
            "seconds": None,
        }

    def test_tool_results_join_the_conversation_and_the_next_round_is_new_work(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        before = Job.objects.get(pk=flow.pk)

        assert round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)]) == "queued"

        job = Job.objects.get(pk=flow.pk)
        assert (job.status, job.lease, job.executor, job.attempts) == ("queued", None, None, 0)
        assert job.conversation == [calling(1), {"role": "tool", "tool_call_id": "call_1", "content": '{"round": 1}'}]
        assert job.ready_at > before.ready_at and job.queued_at == job.ready_at
        queued = JobEvent.objects.filter(job=job, event="queued").last()
        assert queued.meta["round"] == 2 and queued.meta["tools"][0]["name"] == "echo"

        # The next claim is round 2, with the whole conversation.
        again = claim_one()
        start = round_start(again)
        assert start.round == 2 and start.messages[1:] == job.conversation

    def test_an_answer_without_tool_calls_ends_the_flow(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        end = round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=answer("42"), completion_tokens=5)
        assert end.status == "done" and not end.tools_to_run
        job = Job.objects.get(pk=flow.pk)
        assert job.result == {"message": answer("42"), "rounds": 1, "tokens": 5}
        assert job.lease is None and job.finished_at is not None
        assert JobEvent.objects.get(job=job, event="finished").meta == {"rounds": 1, "tokens": 5}

    def test_tool_calls_in_the_last_allowed_round_fail_with_max_rounds(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice, max_rounds=1)
        claim = claim_one()
        assert round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1)).status == "failed"
        job = Job.objects.get(pk=flow.pk)
        assert (job.status, job.error, job.rounds) == ("failed", "max_rounds", 1)


class TestRoundEndsInABatch:
    def test_a_batch_of_round_ends_costs_the_statements_of_one(self, member_setup):
        # Given four flows, each in its first round (the configuration cached by a first end)
        alice = member_setup[0]
        flows = [submit_flow(alice) for _ in range(4)]
        claims = {c.job.pk: c for c in job_claim(worker="w", limit=4).claims}
        assert len(claims) == 4

        def end(*flows: Job) -> list[RoundOutcome]:
            return [
                RoundOutcome(job_id=f.pk, lease=claims[f.pk].lease, round=1, message=calling(1), results=[echoed(1)])
                for f in flows
            ]

        rounds_end(ends=end(flows[0]))
        # When one round ends alone, then two together
        with CaptureQueriesContext(connection) as alone:
            rounds_end(ends=end(flows[1]))
        with CaptureQueriesContext(connection) as together:
            assert rounds_end(ends=end(*flows[2:])) == {flows[2].pk: "queued", flows[3].pk: "queued"}
        # Then the two cost what one does: one update for the jobs, one insert for the events
        assert len(together) == len(alone), [q["sql"][:80] for q in together]
        assert all(job.status == "queued" and job.rounds == 1 for job in Job.objects.filter(pk__in=claims))
        assert [m["role"] for m in Job.objects.get(pk=flows[3].pk).conversation] == ["assistant", "tool"]


class TestToolFailures:
    def test_a_failed_tool_fails_the_flow_with_its_error(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        assert round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1, ok=False)]) == "failed"
        job = Job.objects.get(pk=flow.pk)
        assert job.error == "tool 'echo' raised ValueError: no"

    def test_with_return_tool_errors_the_model_gets_the_error(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice, return_tool_errors=True)
        claim = claim_one()
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        assert round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1, ok=False)]) == "queued"
        last = Job.objects.get(pk=flow.pk).conversation[-1]
        assert last["role"] == "tool" and json.loads(last["content"]) == {"error": "tool 'echo' raised ValueError: no"}


class TestFencing:
    def test_a_round_is_finished_once(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1), completion_tokens=7)
        # The same round again (a retried write whose first try committed) is refused, not billed.
        with pytest.raises(LeaseLost):
            round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1), completion_tokens=7)
        assert Job.objects.get(pk=flow.pk).tokens_used == 7
        assert JobEvent.objects.filter(job=flow, event="round_finished").count() == 1

    def test_an_expired_or_canceled_lease_writes_nothing(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        expire(flow.pk)
        with pytest.raises(LeaseLost):
            round_begin(job_id=flow.pk, lease=claim.lease)
        with pytest.raises(LeaseLost):
            round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=answer())
        assert Job.objects.get(pk=flow.pk).rounds == 0


class TestCrashes:
    def test_death_mid_call_reruns_the_round_without_billing_it(self, member_setup):
        alice = member_setup[0]
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=10_000, window="day")
        flow = submit_flow(alice)
        claim = claim_one()
        expire(flow.pk)
        assert jobs_recover().requeued == [flow.pk]
        usage = Usage.objects.get(scope="team", subject="a")
        assert (usage.tokens, usage.reserved_tokens) == (0, 0)

        again = claim_one()
        assert round_start(again).round == 1
        with pytest.raises(LeaseLost):  # the dead worker's late result
            round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=answer())
        round_finish(job_id=flow.pk, lease=again.lease, round=1, message=answer(), completion_tokens=3)
        usage.refresh_from_db()
        assert (usage.tokens, usage.reserved_tokens) == (3, 0)

    def test_death_before_the_tools_ran_runs_them_next_without_a_model_call(self, member_setup):
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1), completion_tokens=4)
        expire(flow.pk)
        jobs_recover()

        again = claim_one()
        start = round_start(again)
        # No model call in this claim: its slot is given back at once, the tools run.
        assert start.pending == calling(1)["tool_calls"] and start.round == 1
        assert not Slot.objects.exists()
        assert not JobEvent.objects.filter(job=flow, event="round_started", meta__round=2).exists()
        round_requeue(job_id=flow.pk, lease=again.lease, round=1, results=[echoed(1)])
        job = Job.objects.get(pk=flow.pk)
        assert (job.status, job.rounds, job.tokens_used) == ("queued", 1, 4)
        assert JobEvent.objects.filter(job=flow, event="round_finished").count() == 1

    def test_death_while_the_tools_ran_reruns_only_those_without_a_result(self, member_setup):
        # Given a round whose model called two tools, the first recorded as it ended...
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        both = {"role": "assistant", "content": None, "tool_calls": calling(1)["tool_calls"] + calling(2)["tool_calls"]}
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=both)
        assert round_tool_record(job_id=flow.pk, lease=claim.lease, round=1, result=echoed(1))
        assert not round_tool_record(job_id=flow.pk, lease=claim.lease, round=1, result=echoed(1)), "once"

        # When its worker dies before the second ends, and the flow is claimed again...
        expire(flow.pk)
        jobs_recover()
        again = claim_one()
        start = round_start(again)

        # Then only the second call runs again; each result is in the conversation once.
        assert [call["id"] for call in start.pending] == ["call_2"]
        round_requeue(job_id=flow.pk, lease=again.lease, round=1, results=[echoed(2)])
        job = Job.objects.get(pk=flow.pk)
        assert job.status == "queued"
        assert [m.get("tool_call_id") for m in job.conversation] == [None, "call_1", "call_2"]

    def test_all_results_recorded_before_the_requeue(self, member_setup):
        # A worker that recorded every result and died before requeueing leaves a conversation
        # ready for the next round: the next claim calls the model, with no tools to run.
        alice = member_setup[0]
        flow = submit_flow(alice)
        claim = claim_one()
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        round_tool_record(job_id=flow.pk, lease=claim.lease, round=1, result=echoed(1))
        round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)])
        job = Job.objects.get(pk=flow.pk)
        assert job.status == "queued" and [m.get("tool_call_id") for m in job.conversation] == [None, "call_1"]


class TestOrder:
    def test_work_that_became_ready_during_a_round_goes_first(self, member_setup, cap):
        alice = member_setup[0]
        cap("global", None, 1)
        flow = submit_flow(alice)
        claim = claim_one()
        chat = job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "meanwhile"}]},
        )
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)])
        assert claim_one().job.pk == chat.pk

    def test_continue_keeps_the_flows_place_but_not_its_wait(self, member_setup, cap):
        alice = member_setup[0]
        cap("global", None, 1)
        QueuePolicy.objects.update_or_create(pk=1, defaults={"flow_rounds": "continue"})
        flow = submit_flow(alice)
        claim = claim_one()
        job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "meanwhile"}]},
        )
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)])
        job = Job.objects.get(pk=flow.pk)
        assert job.ready_at == flow.ready_at and job.queued_at > flow.queued_at
        assert claim_one().job.pk == flow.pk

    def test_a_higher_priority_job_takes_the_slot_at_the_round_boundary(self, member_setup, cap):
        alice, bob = member_setup[:2]
        cap("global", None, 1)
        QueuePolicy.objects.update_or_create(pk=1, defaults={"flow_rounds": "continue"})
        flow = submit_flow(alice)
        claim = claim_one()
        urgent = job_submit(
            user=bob,
            team="b",
            type="chat",
            priority=5,
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "now"}]},
        )
        assert job_claim(worker="w", limit=1).claims == []  # the round holds the only slot
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)])
        assert claim_one().job.pk == urgent.pk


class TestBudgets:
    def test_each_round_is_billed_and_an_empty_budget_stops_the_next(self, member_setup):
        alice = member_setup[0]
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=45, window="day")
        flow = submit_flow(alice, prompt="go [rounds:9]", max_tokens=1)
        for number in (1, 2):
            claim = claim_one()
            round_finish(job_id=flow.pk, lease=claim.lease, round=number, message=calling(number), completion_tokens=12)
            round_requeue(job_id=flow.pk, lease=claim.lease, round=number, results=[echoed(number)])
        usage = Usage.objects.get(scope="team", subject="a")
        assert (usage.tokens, usage.reserved_tokens) == (24, 0)
        # 21 tokens left; the third round's prompt holds the conversation so far (26 tokens, and 1 for
        # its completion), more than the estimate given (10): the flow waits, deferred.
        assert job_claim(worker="w", limit=1).claims == []
        assert Job.objects.get(pk=flow.pk).status == "queued"
        assert JobEvent.objects.filter(job=flow, event="deferred").exists()


@pytest.mark.parametrize("quick", [False, True], ids=["slow tools", "quick tools"])
def test_a_flow_switched_off_while_it_runs_stops_at_its_next_round_boundary(member_setup, operator, quick):
    # Given a flow in its first round, and the flow feature switched off for its team meanwhile...
    alice, _, team_a, _, _ = member_setup
    flow = submit_flow(alice, prompt="go [rounds:5]")
    claim = claim_one()
    feature_set(feature="flow", team=team_a, enabled=False, by=operator)
    # When its round ends with a tool call and the tool's result (both ways a worker writes it)...
    if quick:
        status = round_end(
            job_id=flow.pk, lease=claim.lease, round=1, message=calling(1), results=[echoed(1)], completion_tokens=4
        )
    else:
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1), completion_tokens=4)
        status = round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)])
    # Then it does not queue its next round: it ends canceled at the boundary, its round billed,
    # as a cancel would have left it, and nothing holds a slot.
    job = Job.objects.get(pk=flow.pk)
    assert status == job.status == "canceled" and job.rounds == 1 and job.tokens_used == 4
    assert "switched off" in job.error and not Slot.objects.exists()
    assert JobEvent.objects.filter(job=flow, event="canceled").exists()
    assert job_claim(worker="w", limit=1).claims == []


def test_an_operator_requeue_starts_a_failed_flow_afresh(member_setup, operator):
    alice = member_setup[0]
    flow = submit_flow(alice, max_rounds=1)
    claim = claim_one()
    round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1), completion_tokens=4)
    job = job_requeue(job_id=flow.pk, by=operator)
    assert (job.status, job.rounds, job.conversation, job.error, job.tokens_used) == ("queued", 0, [], "", 4)
    again = claim_one()
    assert round_start(again).round == 1


class TestAFlowStartsOnce:
    """`started_at` is when a flow's first round started: later rounds, a retried round and a
    round recovered after a crash do not move it (their starts are the `round_started` events and
    the slot's `acquired_at`). So the API and the dashboard show the flow's start, the wait
    histogram counts one wait per flow (submit to first round), and each round is charged to fair
    share for its own slot-seconds, not for the flow's whole life."""

    def test_later_rounds_keep_the_first_start(self, member_setup, api, operator):
        alice = member_setup[0]
        QueuePolicy.objects.update_or_create(pk=QueuePolicy.SINGLETON_ID, defaults={"entry_penalty": 0})
        flow = submit_flow(alice)
        Job.objects.filter(pk=flow.pk).update(submitted_at=timezone.now() - timedelta(seconds=5))
        (claim,) = job_claim(worker="w", limit=1).claims
        first = Job.objects.get(pk=flow.pk).started_at
        round_finish(job_id=flow.pk, lease=claim.lease, round=1, message=calling(1))
        round_requeue(job_id=flow.pk, lease=claim.lease, round=1, results=[echoed(1)])
        # Round 2's model call fails and is retried; the worker running the retry dies.
        (claim,) = job_claim(worker="w", limit=1).claims
        jobs_finish(outcomes=[Outcome(job_id=flow.pk, lease=claim.lease, ok=False, error="boom", retryable=True)])
        Job.objects.filter(pk=flow.pk).update(run_after=None)
        (claim,) = job_claim(worker="w", limit=1).claims
        Job.objects.filter(pk=flow.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
        jobs_recover()
        (claim,) = job_claim(worker="w", limit=1).claims
        assert Job.objects.get(pk=flow.pk).started_at == first
        # The flow is 100 s old by now; its round has held its slot for a moment only.
        Job.objects.filter(pk=flow.pk).update(started_at=first - timedelta(seconds=100))
        first = first - timedelta(seconds=100)
        usage_before = TeamShare.objects.get(team_id=flow.team_id).usage
        round_finish(job_id=flow.pk, lease=claim.lease, round=2, message=answer())
        assert TeamShare.objects.get(team_id=flow.team_id).usage - usage_before < 5

        done = Job.objects.get(pk=flow.pk)
        assert done.status == "done" and done.started_at == first
        assert api(alice).get(f"/api/jobs/{flow.pk}/").json()["started_at"].startswith(first.isoformat()[:19])
        (row,) = dashboard_state(user=alice)["jobs"]
        assert row["started_at"] == first
        scrape = api(operator).get("/metrics").content.decode()
        assert 'telemachus_job_wait_seconds_count{team="a"} 1.0' in scrape
