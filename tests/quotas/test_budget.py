"""Token and request budgets: admission, the claim's gate and reservations, settlement, reset."""

from datetime import timedelta

import pytest
from django.utils import timezone

from quotas.budget import window_bounds
from quotas.models import QuotaPolicy, Usage
from scheduler.models import Job, JobEvent
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.submit import job_submit
from telemachus.errors import QuotaExceeded
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def budget(scope: str, subject: str, dimension: str, limit: int, window: str = "day") -> QuotaPolicy:
    return QuotaPolicy.objects.create(scope=scope, subject=subject, dimension=dimension, limit=limit, window=window)


def submit(user, team="a", est=100):
    """A job whose estimate is `est`: its request can cost no more (a prompt of 5 tokens and a
    completion of at most 1), so the estimate given stands."""
    return job_submit(
        user=user,
        team=team,
        type="chat",
        requirements={"model": "m", "est_tokens": est},
        input={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    )


def ledger(scope="team", subject="a") -> Usage:
    return Usage.objects.get(scope=scope, subject=subject)


class TestWindows:
    @pytest.mark.parametrize(
        ("window", "start", "end"),
        [
            ("minute", "2026-03-31 23:59:00", "2026-04-01 00:00:00"),
            ("hour", "2026-03-31 23:00:00", "2026-04-01 00:00:00"),
            ("day", "2026-03-31 00:00:00", "2026-04-01 00:00:00"),
            ("month", "2026-03-01 00:00:00", "2026-04-01 00:00:00"),
        ],
    )
    def test_fixed_utc_windows(self, window, start, end):
        from datetime import UTC, datetime

        now = datetime(2026, 3, 31, 23, 59, 30, 123, tzinfo=UTC)
        got = window_bounds(window, now)
        assert [t.strftime("%Y-%m-%d %H:%M:%S") for t in got] == [start, end]

    def test_december_rolls_into_january(self):
        from datetime import UTC, datetime

        assert window_bounds("month", datetime(2026, 12, 2, tzinfo=UTC))[1] == datetime(2027, 1, 1, tzinfo=UTC)


class TestAdmission:
    def test_estimate_beyond_the_remaining_budget_is_429(self, api, member_setup):
        budget("team", "a", "ai.tokens", 150)
        response = api(member_setup[0]).post(
            "/api/jobs/", chat_body("a", requirements={"model": "m", "est_tokens": 200}), format="json"
        )
        assert response.status_code == 429
        body = response.json()
        _, end = window_bounds("day", timezone.now())
        assert {k: body[k] for k in ("error", "dimension", "scope", "subject", "limit", "used")} == {
            "error": "quota_exceeded",
            "dimension": "ai.tokens",
            "scope": "team",
            "subject": "a",
            "limit": 150,
            "used": 0,
        }
        assert body["reset_at"] == end.isoformat()
        assert not Job.objects.exists()

    def test_reservations_count_at_admission(self, api, member_setup):
        alice = member_setup[0]
        budget("user", "alice", "ai.tokens", 250)
        submit(alice)
        submit(alice)
        job_claim(worker="w", limit=2)
        response = api(alice).post(
            "/api/jobs/", chat_body("a", requirements={"model": "m", "est_tokens": 100}), format="json"
        )
        assert response.status_code == 429 and response.json()["used"] == 200

    def test_request_budget(self, api, member_setup):
        alice = member_setup[0]
        budget("global", "", "ai.requests", 1, window="minute")
        submit(alice)
        (claim,) = job_claim(worker="w", limit=1).claims
        job_finish(job_id=claim.job.pk, lease=claim.lease, result={}, tokens_used=5)
        response = api(alice).post("/api/jobs/", chat_body("a"), format="json")
        assert response.status_code == 429 and response.json()["dimension"] == "ai.requests"

    def test_other_teams_are_not_affected(self, member_setup):
        budget("team", "a", "ai.tokens", 10)
        with pytest.raises(QuotaExceeded):
            submit(member_setup[0], team="a", est=500)  # the budget binds where it applies
        job = submit(member_setup[1], team="b", est=500)
        assert job.status == Job.Status.QUEUED and job.team.slug == "b"


class TestSpentWhileWaiting:
    """A budget that cannot cover a queued job any more: jobs that wait for it (the default of
    /api/jobs/) stay queued, deferred; jobs that do not (every /v1/ call; `on_budget_exhausted:
    fail`) end at once with the quota error, kept in their `failed` event."""

    def test_a_job_that_does_not_wait_fails_and_one_that_waits_is_deferred(self, member_setup):
        alice = member_setup[0]
        budget("team", "a", "ai.tokens", 100)
        running = submit(alice, est=60)
        waits = submit(alice, est=60)
        fails = job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m", "est_tokens": 60, "on_budget_exhausted": "fail"},
            input={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [running.pk]
        # 40 left of 100, each needs 60.
        assert job_claim(worker="w", limit=2).claims == []
        waits.refresh_from_db(), fails.refresh_from_db()
        assert waits.status == "queued" and JobEvent.objects.filter(job=waits, event="deferred").exists()
        assert fails.status == "failed" and "spent while this job waited" in fails.error
        refusal = JobEvent.objects.get(job=fails, event="failed").meta["refusal"]
        assert refusal["error"] == "quota_exceeded" and refusal["reset_at"] and refusal["scope"] == "team"

    def test_a_spent_teams_jobs_that_do_not_wait_fail_though_its_heads_are_never_read(self, member_setup):
        # Given team a's budget spent outright by what it used, and a job of it that does not wait...
        alice = member_setup[0]
        rule = budget("team", "a", "ai.tokens", 1000)
        fails = job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m", "est_tokens": 10, "on_budget_exhausted": "fail"},
            input={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        QuotaPolicy.objects.filter(pk=rule.pk).update(limit=0)
        # When a claim runs (the team is blocked: its queue is not even looked at)...
        assert job_claim(worker="w", limit=4).claims == []
        # Then the job has ended, refused.
        fails.refresh_from_db()
        assert fails.status == "failed" and JobEvent.objects.filter(job=fails, event="failed").exists()


class TestClaimGate:
    def test_reserves_defers_and_never_blocks_other_teams(self, member_setup):
        alice, bob, *_ = member_setup
        budget("team", "a", "ai.tokens", 300)
        alices = [submit(alice) for _ in range(4)]
        bobs = submit(bob, team="b")
        claimed = [c.job.pk for c in job_claim(worker="w", limit=5).claims]
        assert sorted(claimed) == sorted([*[j.pk for j in alices[:3]], bobs.pk])
        assert (ledger().reserved_tokens, ledger().tokens) == (300, 0)
        assert Job.objects.get(pk=alices[3].pk).status == "queued"
        # One deferred event for the budget running out, however often workers claim.
        job_claim(worker="w", limit=5)
        job_claim(worker="w", limit=5)
        (deferred,) = JobEvent.objects.filter(event="deferred")
        assert deferred.job is None
        assert deferred.meta["scope"] == "team" and deferred.meta["subject"] == "a" and deferred.meta["limit"] == 300

    def test_settling_bills_actual_tokens_and_frees_the_rest(self, member_setup):
        alice = member_setup[0]
        budget("team", "a", "ai.tokens", 300)
        budget("team", "a", "ai.requests", 100)
        jobs = [submit(alice) for _ in range(4)]
        claims = job_claim(worker="w", limit=5).claims
        assert len(claims) == 3
        job_finish(job_id=claims[0].job.pk, lease=claims[0].lease, result={}, tokens_used=30)
        row = ledger()
        assert (row.tokens, row.reserved_tokens, row.requests, row.reserved_requests) == (30, 200, 1, 2)
        assert job_claim(worker="w", limit=5).claims == [], "70 left cannot cover an estimate of 100"
        job_finish(job_id=claims[1].job.pk, lease=claims[1].lease, result={}, tokens_used=30)
        assert [c.job.pk for c in job_claim(worker="w", limit=5).claims] == [jobs[3].pk]
        assert Job.objects.get(pk=claims[0].job.pk).reservation is None

    def test_a_job_bigger_than_what_is_left_is_deferred_once(self, member_setup):
        alice = member_setup[0]
        budget("user", "alice", "ai.tokens", 150)
        submit(alice, est=100)
        job_claim(worker="w", limit=1)
        big = submit(alice, est=40)
        Usage.objects.filter(scope="user").update(reserved_tokens=120)
        for _ in range(3):
            assert job_claim(worker="w", limit=1).claims == []
        (event,) = JobEvent.objects.filter(job=big, event="deferred")
        assert event.meta["estimate"] == 40 and event.meta["used"] == 120

    def test_cancel_releases_the_reservation_and_bills_a_running_attempt_its_estimate(self, member_setup):
        budget("team", "a", "ai.tokens", 300)
        budget("team", "a", "ai.requests", 10)
        queued = submit(member_setup[0], est=40)
        job_cancel(job_id=queued.pk)
        assert not Usage.objects.filter(tokens__gt=0).exists(), "a queued job used nothing"
        assert Job.objects.get(pk=queued.pk).tokens_used == 0
        submit(member_setup[0])
        (claim,) = job_claim(worker="w", limit=1).claims
        assert ledger().reserved_tokens == 100
        job_cancel(job_id=claim.job.pk)
        # The model server may have answered already; an aborted call reports no usage
        assert (ledger().reserved_tokens, ledger().tokens, ledger().requests) == (0, 100, 1)
        job = Job.objects.get(pk=claim.job.pk)
        assert (job.status, job.tokens_used) == ("canceled", 100)
        assert JobEvent.objects.get(job=job, event="canceled").meta["tokens"] == 100

    def test_a_canceled_attempt_with_an_estimate_of_0_bills_what_its_request_could_cost(self, member_setup):
        budget("team", "a", "ai.tokens", 300)
        submit(member_setup[0], est=0)
        (claim,) = job_claim(worker="w", limit=1).claims
        job_cancel(job_id=claim.job.pk)
        assert ledger().tokens == 6 == Job.objects.get(pk=claim.job.pk).tokens_used, "5 of prompt, 1 of completion"

    def test_window_reset_lets_deferred_jobs_run(self, member_setup):
        alice = member_setup[0]
        budget("team", "a", "ai.tokens", 100, window="hour")
        submit(alice)
        waiting = submit(alice)
        (claim,) = job_claim(worker="w", limit=2).claims
        job_finish(job_id=claim.job.pk, lease=claim.lease, result={}, tokens_used=100)
        assert job_claim(worker="w", limit=1).claims == []
        # The clock moves on: the usage now lies in the previous window.
        Usage.objects.update(
            window_start=timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
        )
        assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [waiting.pk]

    def test_executor_budget_moves_work_to_another_executor(self, member_setup, make_executor):
        alice = member_setup[0]
        make_executor("spare", models=["m"])
        budget("executor", "shared", "ai.tokens", 150)
        submit(alice)
        submit(alice)
        placed = [c.executor.name for c in job_claim(worker="w", limit=2).claims]
        assert sorted(placed) == ["shared", "spare"]


class TestUsageApi:
    def test_shows_limit_used_reserved_remaining_and_reset(self, api, member_setup):
        alice = member_setup[0]
        budget("team", "a", "ai.tokens", 1000)
        submit(alice)
        (claim,) = job_claim(worker="w", limit=1).claims
        job_finish(job_id=claim.job.pk, lease=claim.lease, result={}, tokens_used=42)
        submit(alice)
        job_claim(worker="w", limit=1)
        (row,) = api(alice).get("/api/usage/?team=a").json()["results"]
        start, end = window_bounds("day", timezone.now())
        assert row == {
            "policy": row["policy"],
            "scope": "team",
            "subject": "a",
            "dimension": "ai.tokens",
            "window": "day",
            "limit": 1000,
            "used": 42,
            "reserved": 100,
            "remaining": 858,
            "window_start": start.isoformat().replace("+00:00", "Z"),
            "reset_at": end.isoformat().replace("+00:00", "Z"),
        }

    def test_visibility(self, api, operator, member_setup):
        budget("team", "b", "ai.tokens", 1000)
        budget("user", "bob", "ai.tokens", 1000)
        budget("global", "", "ai.requests", 10, window="minute")
        client = api(member_setup[0])
        assert [r["scope"] for r in client.get("/api/usage/").json()["results"]] == ["global"]
        assert client.get("/api/usage/?team=b").status_code == 404
        assert client.get("/api/usage/?user=bob").status_code == 404
        assert len(api(operator).get("/api/usage/").json()["results"]) == 3
        assert [r["subject"] for r in api(operator).get("/api/usage/?user=bob").json()["results"]] == [None, "bob"]


def test_a_second_pass_of_the_claim_never_takes_a_job_twice(member_setup):
    """Jobs passed over for budget make the claim ask the policy again; the jobs it already took
    are still queued in the database at that point and come back, and must be skipped."""
    from scheduler.models import Slot

    alice = member_setup[0]
    budget("team", "a", "ai.tokens", 150)
    jobs = [submit(alice, est=est) for est in (100, 100, 10, 10)]
    claimed = [c.job.pk for c in job_claim(worker="w", limit=10).claims]
    assert claimed == [jobs[0].pk, jobs[2].pk, jobs[3].pk]
    assert Slot.objects.count() == 3
    assert ledger().reserved_tokens == 120
