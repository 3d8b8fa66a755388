"""Model routes at submit, claim and finish (issue #39): which model a routed job starts on, and
each move to the next, with its event and why. The real-server tests are in
tests/scheduler/gateway/test_routes.py."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from executors.models import Executor
from executors.routes import route_create
from quotas.models import Spend
from scheduler.models import Job, JobEvent
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, jobs_finish
from scheduler.services.policy import queue_policy_update
from scheduler.services.submit import job_submit
from telemachus.errors import UnknownModel, ValidationFailed
from telemachus.keys.services import api_key_create

pytestmark = pytest.mark.django_db

LONG = [{"role": "user", "content": "word " * 400}]


@pytest.fixture
def routed(member_setup, make_executor):
    """alice in team a; executors `ea` (model a, window 100 tokens) and `eb` (model b); the route
    `smart` = a, then b."""
    alice, _, team_a, _, shared = member_setup
    shared.delete()
    ea = make_executor("ea", models=["a"], max_concurrency=1)
    ea.capabilities = {"models": ["a"], "context_window": 100}
    ea.save()
    eb = make_executor("eb", models=["b"], max_concurrency=1)
    route_create(name="smart", models=["a", "b"])
    return alice, team_a, ea, eb


def call(user, model="smart", messages=None, **requirements):
    return job_submit(
        user=user,
        team="a",
        type="chat",
        requirements={"model": model, **requirements},
        input={"messages": messages or [{"role": "user", "content": "hi"}]},
    )


def moves(job):
    return [
        (e.meta["from"], e.meta["to"], e.meta["reason"]) for e in JobEvent.objects.filter(job=job, event="fell_back")
    ]


class TestSubmit:
    def test_a_route_starts_on_its_first_model(self, routed):
        job = call(routed[0])
        assert (job.model, job.route, job.route_models) == ("a", "smart", ["a", "b"])
        assert job.requirements["model"] == "smart", "what the caller asked for"
        assert moves(job) == []

    def test_a_model_whose_breaker_is_open_is_passed_over(self, routed):
        alice, _, ea, _ = routed
        Executor.objects.filter(pk=ea.pk).update(breaker="open", breaker_until=timezone.now() + timedelta(minutes=1))
        job = call(alice)
        assert job.model == "b" and moves(job) == [("a", "b", "no_executor")]

    def test_when_no_model_takes_work_it_waits_on_the_first(self, routed):
        alice, _, ea, eb = routed
        Executor.objects.filter(pk__in=[ea.pk, eb.pk]).update(health="down")
        assert call(alice).model == "a"

    def test_a_prompt_longer_than_the_window_goes_to_the_next_model(self, routed):
        job = call(routed[0], messages=LONG)
        assert job.model == "b" and moves(job) == [("a", "b", "context_window")]

    def test_a_prompt_no_window_holds_is_refused(self, routed, make_executor):
        alice, _, _, eb = routed
        eb.capabilities = {"models": ["b"], "context_window": 50}
        eb.save()
        with pytest.raises(ValidationFailed) as refused:
            call(alice, messages=LONG)
        assert "largest context window is 100" in str(refused.value)

    def test_a_route_with_no_model_of_the_team_is_unknown(self, routed):
        Executor.objects.all().update(enabled=False)
        with pytest.raises(UnknownModel):
            call(routed[0])

    def test_a_key_list_names_the_route(self, routed):
        _, team_a, _, _ = routed
        key, _ = api_key_create(team=team_a, name="app", models=["smart"], by=None)
        assert call(key.principal).model == "a"
        with pytest.raises(UnknownModel):
            job_submit(
                user=key.principal,
                team="a",
                type="chat",
                requirements={"model": "a"},
                input={"messages": [{"role": "user", "content": "hi"}]},
                key=key,
            )


class TestClaim:
    def test_a_waiting_job_moves_on_when_its_model_stops_taking_work(self, routed):
        alice, _, ea, eb = routed
        blocker = call(alice)
        job_claim(worker="w", limit=1)  # ea's only slot
        job = call(alice)
        assert job.model == "a" and not job_claim(worker="w", limit=1).claims
        # When ea's breaker opens, the next claim moves the waiting job to b, and then starts it.
        Executor.objects.filter(pk=ea.pk).update(breaker="open", breaker_until=timezone.now() + timedelta(minutes=1))
        batch = job_claim(worker="w", limit=1)
        assert batch.backlog and batch.wake_in == 0
        job.refresh_from_db()
        assert job.model == "b" and moves(job) == [("a", "b", "no_executor")]
        (claim,) = job_claim(worker="w", limit=1).claims
        assert claim.job.pk == job.pk and claim.executor == eb
        assert blocker.pk != job.pk

    def test_past_its_deadline_a_routed_job_moves_to_a_free_model(self, routed):
        alice, _, ea, eb = routed
        call(alice)
        job_claim(worker="w", limit=1)  # ea's only slot
        job = call(alice, max_queue_seconds=0)
        job_claim(worker="w", limit=1)
        job.refresh_from_db()
        assert job.model == "b" and moves(job) == [("a", "b", "queue_deadline")]
        (claim,) = job_claim(worker="w", limit=1).claims
        assert claim.job.pk == job.pk and claim.executor == eb
        claim.job.refresh_from_db()
        assert claim.job.queue_deadline is None, "a started job has no deadline left"

    def test_past_its_deadline_with_nowhere_free_a_job_ends_429(self, routed):
        alice = routed[0]
        call(alice, model="b")
        job_claim(worker="w", limit=1)  # eb's only slot
        job = call(alice, model="b", max_queue_seconds=0.5)
        job_claim(worker="w", limit=1)
        job.refresh_from_db()
        assert job.status == "queued", "not before its deadline"
        Job.objects.filter(pk=job.pk).update(queue_deadline=timezone.now() - timedelta(seconds=1))
        job_claim(worker="w", limit=1)
        job.refresh_from_db()
        assert job.status == "failed" and "queue deadline of 0.5 s" in job.error
        refusal = job.events.get(event="failed").meta["refusal"]
        assert refusal["error"] == "queue_deadline_exceeded" and refusal["retry_after"] == 1

    def test_the_claim_wakes_for_the_next_deadline(self, routed):
        alice = routed[0]
        call(alice, model="b")
        job_claim(worker="w", limit=1)
        call(alice, model="b", max_queue_seconds=30)
        batch = job_claim(worker="w", limit=1)
        assert batch.wake_in is not None and 25 < batch.wake_in <= 30


class TestFinish:
    def test_a_retryable_failure_after_the_retries_moves_to_the_next_model(self, routed):
        alice, _, ea, eb = routed
        queue_policy_update(changes={"max_attempts": 1}, by=None)
        ea.prices = {"a": {"input": "1000000", "output": "1000000"}}
        ea.save()
        eb.prices = {"b": {"input": "2000000", "output": "2000000"}}
        eb.save()
        job = call(alice)
        (claim,) = job_claim(worker="w", limit=1).claims
        jobs_finish(
            outcomes=[Outcome(job_id=job.pk, lease=claim.lease, ok=False, error="boom", retryable=True, tokens_used=3)]
        )
        job.refresh_from_db()
        assert (job.status, job.model, job.attempts, job.executor_id) == ("queued", "b", 0, None)
        assert moves(job) == [("a", "b", "failed")]
        (claim,) = job_claim(worker="w", limit=1).claims
        assert claim.executor == eb
        jobs_finish(outcomes=[Outcome(job_id=job.pk, lease=claim.lease, ok=True, result={"text": "ok"}, tokens_used=5)])
        job.refresh_from_db()
        assert job.status == "done" and job.tokens_used == 8
        # Billed per model that ran: 3 tokens of a at 1 each, 5 of b at 2 each.
        spent = {row.model: (row.tokens, row.cost) for row in Spend.objects.all()}
        assert spent == {"a": (3, Decimal(3)), "b": (5, Decimal(10))}
        assert job.cost == Decimal(13)

    def test_the_last_model_ends_the_job(self, routed):
        alice = routed[0]
        queue_policy_update(changes={"max_attempts": 1}, by=None)
        job = call(alice, model="b")
        (claim,) = job_claim(worker="w", limit=1).claims
        jobs_finish(outcomes=[Outcome(job_id=job.pk, lease=claim.lease, ok=False, error="boom", retryable=True)])
        job.refresh_from_db()
        assert job.status == "failed" and moves(job) == []
