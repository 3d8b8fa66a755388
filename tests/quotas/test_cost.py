"""Money: prices per model on executors, a job's cost, `ai.cost` budgets reserved at the claim and
settled to the actual cost, the `key` scope, and the spend ledger behind GET /api/spend/."""

from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from quotas.budget import window_bounds
from quotas.models import QuotaPolicy, Spend, Usage
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, jobs_finish
from scheduler.services.rounds import round_claimed, round_finish
from scheduler.services.submit import job_submit
from telemachus.errors import QuotaExceeded
from telemachus.keys.services import api_key_create
from telemachus.models import AuditEvent
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db

# Per 1M tokens: 2 for input, 10 for output. "hello" is a 5-token prompt (tokens.py counts 4 per
# message and one per word); max_tokens 16. Estimate: 5 x 2 + 16 x 10 = 170 millionths.
PRICES = {"m": {"input": "2", "output": "10"}}
ESTIMATE = Decimal("0.00017")


@pytest.fixture
def priced(member_setup):
    alice, bob, team_a, team_b, shared = member_setup
    shared.prices = PRICES
    shared.save(update_fields=["prices"])
    return member_setup


def submit(user, team="a", max_tokens=16, key=None, model="m"):
    return job_submit(
        user=user,
        team=team,
        type="chat",
        requirements={"model": model},
        input={"messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens},
        key=key,
    )


def finish(claim, prompt=5, completion=7):
    report = jobs_finish(
        outcomes=[
            Outcome(
                job_id=claim.job.pk,
                lease=claim.lease,
                ok=True,
                result={"message": {"role": "assistant", "content": "x"}},
                tokens_used=prompt + completion,
                meta={"prompt_tokens": prompt, "completion_tokens": completion},
            )
        ]
    )
    assert report.accepted == [claim.job.pk]


def money_budget(scope, subject, limit, window="day"):
    return QuotaPolicy.objects.create(
        scope=scope, subject=subject, dimension="ai.cost", limit=Decimal(limit), window=window
    )


class TestPricing:
    def test_the_attempt_is_billed_tokens_times_price_exactly(self, priced):
        alice = priced[0]
        money_budget("team", "a", "0.01")
        job = submit(alice)
        assert (job.est_prompt_tokens, job.est_completion_tokens) == (5, 16)
        (claim,) = job_claim(worker="w").claims
        # The claim reserved the estimate priced on the executor it chose.
        assert claim.job.reservation["cost"] == "0.00017"
        assert Usage.objects.get(scope="team", subject="a").reserved_cost == ESTIMATE
        finish(claim, prompt=5, completion=7)
        job.refresh_from_db()
        billed = (5 * Decimal(2) + 7 * Decimal(10)) / 1_000_000
        assert job.cost == billed == Decimal("0.00008")
        row = Usage.objects.get(scope="team", subject="a")
        assert (row.cost, row.reserved_cost, row.tokens) == (billed, 0, 0)
        spend = Spend.objects.get()
        assert (spend.team, spend.user, spend.model, spend.requests, spend.tokens) == (priced[2], alice, "m", 1, 12)
        assert (spend.prompt_tokens, spend.completion_tokens, spend.cost) == (5, 7, billed)
        assert JobEvent.objects.get(job=job, event="finished").meta["cost"] == "0.00008"

    def test_no_price_no_cost(self, member_setup):
        job = submit(member_setup[0])
        (claim,) = job_claim(worker="w").claims
        finish(claim)
        job.refresh_from_db()
        assert job.cost == 0
        assert Spend.objects.get().tokens == 12 and Spend.objects.get().cost == 0

    def test_a_canceled_attempt_is_billed_its_reserved_estimate(self, priced):
        money_budget("global", "", "1")
        job = submit(priced[0])
        job_claim(worker="w")
        job_cancel(job_id=job.pk)
        job.refresh_from_db()
        # The reserved money; the reserved tokens (a job without est_tokens is estimated at its
        # prompt, 5, plus its max_tokens, 16).
        assert (job.cost, job.tokens_used) == (ESTIMATE, 5 + 16)
        row = Usage.objects.get(scope="global")
        assert (row.cost, row.reserved_cost) == (ESTIMATE, 0)

    def test_a_flow_round_is_billed_on_its_executor(self, priced, make_executor):
        alice = priced[0]
        job = job_submit(
            user=alice,
            team="a",
            type="flow",
            requirements={"model": "m", "est_tokens": 50},
            input={"messages": [{"role": "user", "content": "plan"}]},
        )
        (claim,) = job_claim(worker="w").claims
        start = round_claimed(claim.job)  # the round the claim started, as the worker takes it
        assert start is not None
        round_finish(
            job_id=job.pk,
            lease=claim.lease,
            round=start.round,
            message={"role": "assistant", "content": "done"},
            prompt_tokens=100,
            completion_tokens=20,
        )
        job.refresh_from_db()
        assert job.status == "done" and job.cost == Decimal("0.0004")  # 100 x 2 + 20 x 10 millionths
        assert Spend.objects.get().cost == Decimal("0.0004")


class TestMoneyBudgets:
    def test_admission_refuses_what_the_budget_cannot_cover(self, api, priced):
        money_budget("team", "a", "0.0001")  # less than one estimate (0.00017)
        response = api(priced[0]).post("/api/jobs/", chat_body("a"), format="json")
        assert response.status_code == 429, response.json()
        body = response.json()
        _, end = window_bounds("day", timezone.now())
        assert (body["error"], body["dimension"], body["limit"], body["used"]) == (
            "quota_exceeded",
            "ai.cost",
            "0.0001",
            "0",
        )
        assert body["reset_at"] == end.isoformat()
        assert "0.0001 left" in body["detail"] and "needs 0.00017" in body["detail"]

    def test_the_claim_defers_when_what_is_left_cannot_cover_the_estimate(self, priced):
        alice = priced[0]
        money_budget("team", "a", "0.0003")  # room for one estimate (0.00017), not two
        first, second = submit(alice), submit(alice)
        claims = job_claim(worker="w", limit=10).claims
        assert [c.job.pk for c in claims] == [first.pk]
        assert Job.objects.get(pk=second.pk).status == "queued"
        assert JobEvent.objects.filter(job=second, event="deferred", meta__dimension="ai.cost").exists()
        finish(claims[0])  # billed 0.00008: 0.00022 left, enough for the second
        assert [c.job.pk for c in job_claim(worker="w").claims] == [second.pk]

    def test_admission_prices_on_the_dearest_executor_that_could_take_it(self, priced, make_executor):
        make_executor("dear", models=["m"], prices={"m": {"input": "20", "output": "100"}})
        money_budget("team", "a", "0.001")  # covers the estimate on shared (0.00017), not on dear (0.0017)
        with pytest.raises(QuotaExceeded):
            submit(priced[0])


class TestKeyScope:
    def test_a_key_cap_and_a_key_budget(self, priced):
        key, _ = api_key_create(team=priced[2], name="app")
        QuotaPolicy.objects.create(scope="key", subject=str(key.pk), dimension="ai.concurrency", limit=1)
        money_budget("key", str(key.pk), "0.0003")
        jobs = [submit(key.principal, key=key) for _ in range(3)]
        alices = submit(priced[0])
        claims = job_claim(worker="w", limit=10).claims
        assert {c.job.pk for c in claims} == {jobs[0].pk, alices.pk}, "one slot for the key; alice is not capped"
        assert Slot.objects.filter(user=key.principal).count() == 1
        finish(next(c for c in claims if c.job.pk == jobs[0].pk))
        (second,) = job_claim(worker="w", limit=10).claims
        finish(second)
        # 2 x 0.00008 = 0.00016 spent; 0.00014 left cannot cover another 0.00017.
        assert job_claim(worker="w", limit=10).claims == []
        row = Usage.objects.get(scope="key", subject=str(key.pk))
        assert row.cost == Decimal("0.00016") and row.reserved_cost == 0
        with pytest.raises(QuotaExceeded) as refused:
            submit(key.principal, key=key)
        assert refused.value.extra["scope"] == "key" and refused.value.extra["subject"] == str(key.pk)

    def test_key_rules_name_keys_by_id(self, api, operator, priced):
        key, _ = api_key_create(team=priced[2], name="app")
        client = api(operator)
        ok = client.post(
            "/api/quota-policies/",
            {"scope": "key", "subject": str(key.pk), "dimension": "ai.concurrency", "limit": 2},
            format="json",
        )
        assert ok.status_code == 201 and ok.json()["limit"] == 2
        for subject in ("app", "999999"):
            bad = client.post(
                "/api/quota-policies/",
                {"scope": "key", "subject": subject, "dimension": "ai.tokens", "limit": 5, "window": "day"},
                format="json",
            )
            assert bad.status_code == 400 and "subject" in bad.json()["fields"]


class TestApi:
    def test_money_limits_are_decimal_strings(self, api, operator, priced):
        client = api(operator)
        created = client.post(
            "/api/quota-policies/",
            {"scope": "team", "subject": "a", "dimension": "ai.cost", "limit": "0.0042", "window": "month"},
            format="json",
        )
        assert created.status_code == 201, created.json()
        assert created.json()["limit"] == "0.0042"
        assert AuditEvent.objects.get(action="quota_policy.create").after["limit"] == "0.0042"
        fractional = client.post(
            "/api/quota-policies/",
            {"scope": "team", "subject": "a", "dimension": "ai.tokens", "limit": "1.5", "window": "day"},
            format="json",
        )
        assert fractional.status_code == 400 and "limit" in fractional.json()["fields"]
        usage = api(priced[0]).get("/api/usage/").json()["results"]
        assert usage[0]["limit"] == "0.0042" and usage[0]["remaining"] == "0.0042"

    def test_prices_are_set_by_patch_checked_and_audited(self, api, operator, priced):
        shared = priced[4]
        client = api(operator)
        response = client.patch(
            f"/api/executors/{shared.pk}/", {"prices": {"m": {"input": "0.15", "output": 0.6}}}, format="json"
        )
        assert response.status_code == 200, response.json()
        assert response.json()["prices"] == {"m": {"input": "0.15", "output": "0.6"}}
        event = AuditEvent.objects.filter(action="executor.update").latest("id")
        assert event.before == {"prices": PRICES} and event.after == {
            "prices": {"m": {"input": "0.15", "output": "0.6"}}
        }
        for bad in (
            {"m": {"input": "-1"}},
            {"m": {"input": "0.0000001"}},
            {"m": {"in": "1"}},
            {"m": "1"},
            {"m": {"output": "lots"}},
        ):
            refused = client.patch(f"/api/executors/{shared.pk}/", {"prices": bad}, format="json")
            assert refused.status_code == 400 and "prices" in refused.json()["fields"], bad

    def test_spend_by_day_and_who_sees_it(self, api, operator, priced):
        alice, bob = priced[0], priced[1]
        key, secret = api_key_create(team=priced[2], name="app")
        for user, k in ((alice, None), (key.principal, key), (key.principal, key)):
            submit(user, key=k)
            (claim,) = job_claim(worker="w").claims
            finish(claim)
        today = timezone.now().date().isoformat()
        mine = api(alice).get("/api/spend/?team=a").json()
        assert mine["currency"] == "USD" and [d["day"] for d in mine["results"]] == [today]
        assert mine["total"] == {
            "requests": 3,
            "tokens": 36,
            "prompt_tokens": 15,
            "completion_tokens": 21,
            "cost": "0.00024",
        }
        by_key = api(alice).get(f"/api/spend/?key={key.pk}&from={today}&to={today}").json()["total"]
        assert (by_key["requests"], by_key["cost"]) == (2, "0.00016")
        assert api(alice).get("/api/spend/?user=alice").json()["total"]["cost"] == "0.00008"
        assert api(alice).get("/api/spend/?model=other").json()["total"]["cost"] == "0"
        # Bob is not in team a: its spend is not his to see.
        assert api(bob).get("/api/spend/?team=a").status_code == 404
        assert api(bob).get("/api/spend/").json()["total"]["requests"] == 0
        assert api(bob).get(f"/api/spend/?key={key.pk}").status_code == 404
        assert api(operator).get("/api/spend/").json()["total"]["requests"] == 3
        # The key sees its own spend only.
        app = APIClient()
        app.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert app.get("/api/spend/").json()["total"]["cost"] == "0.00016"
        assert api(alice).get("/api/spend/?from=2026-02-01&to=2026-01-01").status_code == 400
        assert api(alice).get("/api/spend/?tean=a").status_code == 400

    def test_the_cost_metric(self, api, operator, priced):
        submit(priced[0])
        (claim,) = job_claim(worker="w").claims
        finish(claim)
        text = api(operator).get("/metrics").content.decode()
        assert 'telemachus_cost_total{currency="USD",model="m",team="a"} 8e-05' in text


def test_the_admin_takes_amounts_for_money_and_whole_numbers_for_the_rest(client, operator, priced):
    client.force_login(operator)
    form = {"scope": "team", "subject": "a", "window": "day"}
    refused = client.post("/admin/quotas/quotapolicy/add/", {**form, "dimension": "ai.tokens", "limit": "1.5"})
    assert refused.status_code == 200 and b"A whole number for ai.tokens" in refused.content
    added = client.post("/admin/quotas/quotapolicy/add/", {**form, "dimension": "ai.cost", "limit": "0.005"})
    assert added.status_code == 302
    assert QuotaPolicy.objects.get(dimension="ai.cost").limit == Decimal("0.005")
    assert b"0.005" in client.get("/admin/quotas/quotapolicy/").content
