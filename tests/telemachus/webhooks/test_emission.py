"""What puts an event in the outbox, from each layer, in the transaction of the change: budgets
settled past 80 % and 100 % (once per rule, window and threshold), an executor down and back, a
breaker opened, a job failed for good."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.utils import timezone

from executors.contract import Probe
from executors.health import DispatchReport, breaker_record, probe_record
from quotas.budget import Bill, quota_settle
from quotas.models import QuotaPolicy
from scheduler.models import Job, QueuePolicy
from scheduler.services.claim import job_claim
from scheduler.services.recover import jobs_recover
from scheduler.services.submit import job_submit
from telemachus.models import WebhookDelivery
from telemachus.webhooks.services import EVENTS, webhook_create

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 5, 4, 12, 0, tzinfo=UTC)


@pytest.fixture
def hooks(member_setup, private_allowed):
    """Given a webhook for every event type in team a and in team b."""
    _, _, team_a, team_b, _ = member_setup
    for team in (team_a, team_b):
        webhook_create(team=team, url="http://127.0.0.1:9/hook", events=list(EVENTS))
    return member_setup


def emitted(team: str | None = None) -> list[tuple[str, dict]]:
    rows = WebhookDelivery.objects.order_by("id").select_related("webhook__team")
    if team is not None:
        rows = rows.filter(webhook__team__slug=team)
    return [(row.event, row.payload["data"]) for row in rows]


class TestBudgets:
    def settle(self, alice, team, tokens=0, cost=Decimal(0)):
        quota_settle(
            reservations=[],
            bills=[Bill(team_id=team.pk, user_id=alice.pk, executor_id=None, tokens=tokens, cost=cost, model="m")],
            now=NOW,
        )

    def test_each_threshold_once_per_window(self, hooks):
        alice, _, team_a, _, _ = hooks
        QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=1000, window="day")
        for tokens, wanted in [
            (700, []),
            (150, ["budget.threshold"]),
            (100, []),
            (50, ["budget.exhausted"]),
            (500, []),
        ]:
            before = WebhookDelivery.objects.count()
            self.settle(alice, team_a, tokens=tokens)
            assert [event for event, _ in emitted("a")[before:]] == wanted, tokens
        threshold, exhausted = (data for _, data in emitted("a"))
        assert threshold["threshold_percent"] == 80 and threshold["used"] == 850
        assert threshold["budget"] == {
            "rule": QuotaPolicy.objects.get().pk,
            "scope": "team",
            "subject": "a",
            "dimension": "ai.tokens",
            "window": "day",
            "limit": 1000,
        }
        assert exhausted["threshold_percent"] == 100 and exhausted["used"] == 1000
        assert exhausted["reset_at"] == "2026-05-05T00:00:00+00:00"
        assert emitted("b") == []  # team a's budget is team a's business
        # The next window starts over.
        quota_settle(
            reservations=[],
            bills=[Bill(team_id=team_a.pk, user_id=alice.pk, executor_id=None, tokens=900, model="m")],
            now=NOW.replace(day=5),
        )
        assert [event for event, _ in emitted("a")[2:]] == ["budget.threshold"]

    def test_money_budgets_and_both_thresholds_at_once(self, hooks):
        alice, _, team_a, _, _ = hooks
        QuotaPolicy.objects.create(
            scope="user", subject="alice", dimension="ai.cost", limit=Decimal("2.00"), window="month"
        )
        self.settle(alice, team_a, cost=Decimal("2.50"))
        assert [(event, data["used"], data["budget"]["limit"]) for event, data in emitted("a")] == [
            ("budget.threshold", "2.5", "2"),
            ("budget.exhausted", "2.5", "2"),
        ]
        assert emitted("b") == []  # alice's jobs ran in team a

    def test_a_global_budget_concerns_every_team_and_requests_none(self, hooks):
        alice, _, team_a, _, _ = hooks
        QuotaPolicy.objects.create(scope="global", dimension="ai.tokens", limit=100, window="hour")
        QuotaPolicy.objects.create(scope="global", dimension="ai.requests", limit=1, window="hour")
        self.settle(alice, team_a, tokens=80)
        assert [event for event, _ in emitted("a")] == [event for event, _ in emitted("b")] == ["budget.threshold"]


class TestExecutors:
    def test_down_and_up(self, hooks, make_executor):
        _, _, _, team_b, shared = hooks
        own = make_executor("b-own", team=team_b)
        probe_record(results=[(shared.pk, Probe(health="down", detail="refused")), (own.pk, Probe(health="down"))])
        assert sorted((event, data["executor"]["name"]) for event, data in emitted("a")) == [
            ("executor.down", "shared")
        ]
        assert sorted((event, data["executor"]["name"]) for event, data in emitted("b")) == [
            ("executor.down", "b-own"),
            ("executor.down", "shared"),
        ]
        before = WebhookDelivery.objects.count()
        probe_record(results=[(shared.pk, Probe(health="degraded"))])
        (up,) = [data for _, data in emitted("a")[1:]]
        assert (up["was"], up["health"]) == ("down", "degraded")
        probe_record(results=[(shared.pk, Probe(health="ok"))])  # degraded -> ok: nothing to act on
        assert WebhookDelivery.objects.count() == before + 2

    def test_breaker_opened(self, hooks, settings):
        _, _, _, _, shared = hooks
        settings.TELEMACHUS_BREAKER_THRESHOLD = 2
        fault = DispatchReport(executor_id=shared.pk, ok=False, executor_fault=True)
        breaker_record(reports=[fault])
        assert emitted() == []
        breaker_record(reports=[fault])
        assert [(event, data["failures"]) for event, data in emitted("a")] == [("breaker.opened", 2)]
        breaker_record(reports=[DispatchReport(executor_id=shared.pk, ok=True)])  # closed again: no event
        assert len(emitted()) == 2


class TestJobs:
    def test_a_job_failed_by_recovery(self, hooks):
        alice, _, _, _, _ = hooks
        QueuePolicy.objects.update_or_create(pk=1, defaults={"recovery": "fail"})
        job = job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "x"}]},
        )
        job_claim(worker="w1", limit=1)
        Job.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now())
        assert jobs_recover().failed == [job.pk]
        ((event, data),) = emitted("a")
        assert event == "job.failed" and data["job"]["id"] == job.pk and "lease expired" in data["job"]["error"]
        assert emitted("b") == []
