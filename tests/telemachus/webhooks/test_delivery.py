"""Delivering the outbox to a real receiver process that verifies every signature with the
`standardwebhooks` package: delivered, retried with backoff, given up, never sent for a change
that rolled back, and checked again before each attempt (a name that now resolves inside the
network is not connected to)."""

import pytest
from django.db import transaction

from scheduler.models import Job
from scheduler.services.claim import job_claim
from scheduler.services.finish import job_finish
from scheduler.services.submit import job_submit
from telemachus.models import Team, Webhook, WebhookDelivery
from telemachus.webhooks.delivery import webhooks_deliver
from telemachus.webhooks.services import WebhookEvent, webhook_create, webhooks_emit
from tests.processes import wait_until

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


@pytest.fixture
def hook(receiver, member_setup, private_allowed, settings):
    """Given team a's webhook to the receiver for failed jobs, the receiver holding its secret."""
    settings.TELEMACHUS_WEBHOOKS_RETRY_BASE_SECONDS = 0.01
    settings.TELEMACHUS_WEBHOOKS_RETRY_MAX_SECONDS = 0.05
    _, _, team_a, _, _ = member_setup
    webhook, secret = webhook_create(team=team_a, url=receiver.url, events=["job.failed", "budget.exhausted"])
    receiver.configure(secret=secret, fail_first=0, delay=0)
    return webhook


def emit(team: Team, **data) -> None:
    webhooks_emit(events=[WebhookEvent(type="budget.exhausted", data=data, teams=frozenset({team.pk}))])


def attempts(delivery: WebhookDelivery) -> list[tuple]:
    return list(delivery.attempt_log.order_by("id").values_list("status_code", "error"))


def delivered_until(status: str) -> None:
    """Run the delivery loop until the one delivery is `status` (its backoff is milliseconds)."""
    wait_until(
        lambda: (webhooks_deliver(), WebhookDelivery.objects.get().status)[1] == status,
        timeout=10,
        what=f"the delivery to be {status}",
    )


def test_a_failed_job_is_delivered_signed(hook, receiver, member_setup):
    alice, _, team_a, _, _ = member_setup
    job = job_submit(
        user=alice,
        team="a",
        type="chat",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "hi"}]},
    )
    (claim,) = job_claim(worker="w1", limit=1).claims
    assert job_finish(job_id=job.pk, lease=claim.lease, error="upstream 400: bad model")
    assert webhooks_deliver() == 1
    (accepted,) = receiver.accepted()
    assert (accepted["type"], accepted["attempt"]) == ("job.failed", 1)
    assert accepted["data"]["team"] == "a"
    assert accepted["data"]["job"]["id"] == job.pk and accepted["data"]["job"]["error"] == "upstream 400: bad model"
    assert "input" not in accepted["data"]["job"] and Job.objects.get(pk=job.pk).status == "failed"
    delivery = WebhookDelivery.objects.get()
    assert (delivery.status, delivery.attempts, delivery.message_id) == ("delivered", 1, accepted["id"])
    (attempt,) = delivery.attempt_log.all()
    assert attempt.status_code == 200 and accepted["id"] in attempt.response_excerpt
    assert webhooks_deliver() == 0  # nothing is sent twice


def test_retried_after_the_receiver_fails_twice(hook, receiver, api, member_setup, make_user):
    _, _, team_a, _, _ = member_setup
    receiver.configure(fail_first=2)
    emit(team_a, budget={"scope": "team"})
    delivered_until("delivered")
    delivery = WebhookDelivery.objects.get()
    assert delivery.attempts == 3 and [code for code, _ in attempts(delivery)] == [500, 500, 200]
    assert len({a["id"] for a in receiver.accepted()}) == 1 and receiver.seen()["attempts"] == {delivery.message_id: 3}
    # The team's managers see each attempt and what the receiver said.
    manager = make_user("mia")
    team_a.memberships.create(user=manager, role="manager")
    (shown,) = api(manager).get(f"/api/webhooks/{hook.pk}/deliveries/").json()["results"]
    assert [a["status_code"] for a in shown["attempt_log"]] == [500, 500, 200]
    assert "failing attempt 1 on purpose" in shown["attempt_log"][0]["response_excerpt"]


def test_given_up_after_the_last_attempt(hook, receiver, member_setup, settings):
    _, _, team_a, _, _ = member_setup
    settings.TELEMACHUS_WEBHOOKS_MAX_ATTEMPTS = 2
    receiver.configure(fail_first=5)
    emit(team_a)
    delivered_until("failed")
    assert [code for code, _ in attempts(WebhookDelivery.objects.get())] == [500, 500]


def test_a_wrong_signature_is_refused_by_the_receiver(hook, receiver, member_setup):
    _, _, team_a, _, _ = member_setup
    receiver.configure(secret="whsec_" + "A" * 43 + "=")
    emit(team_a)
    webhooks_deliver()
    assert receiver.seen()["rejected"] == 1 and receiver.accepted() == []
    delivery = WebhookDelivery.objects.get()
    assert delivery.status == "pending" and attempts(delivery) == [(401, "")]


def test_nothing_is_sent_for_a_change_that_rolled_back(hook, receiver, member_setup):
    _, _, team_a, _, _ = member_setup
    with pytest.raises(RuntimeError), transaction.atomic():
        emit(team_a)
        raise RuntimeError("the change fails")
    assert not WebhookDelivery.objects.exists() and webhooks_deliver() == 0


def test_the_address_is_checked_again_before_each_attempt(hook, receiver, member_setup, settings):
    """Registered while allowed; by delivery time the name resolves somewhere refused (as a DNS
    rebinding would make it): nothing is sent."""
    _, _, team_a, _, _ = member_setup
    settings.TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE = False
    emit(team_a)
    webhooks_deliver()
    ((code, error),) = attempts(WebhookDelivery.objects.get())
    assert code is None and error.startswith("not sent: 127.0.0.1 resolves to 127.0.0.1 (loopback)")
    assert receiver.seen()["attempts"] == {}


def test_a_slow_receiver_is_cut_off_at_the_timeout(hook, receiver, member_setup, settings):
    _, _, team_a, _, _ = member_setup
    settings.TELEMACHUS_WEBHOOKS_TIMEOUT_SECONDS = 0.3
    receiver.configure(delay=3)
    emit(team_a)
    webhooks_deliver()
    delivery = WebhookDelivery.objects.get()
    ((code, error),) = attempts(delivery)
    assert code is None and "Timeout" in error
    assert delivery.attempt_log.get().duration_ms < 2000 and delivery.status == "pending"


def test_a_disabled_webhook_sends_nothing(hook, receiver, member_setup):
    _, _, team_a, _, _ = member_setup
    emit(team_a)
    Webhook.objects.update(enabled=False)
    assert webhooks_deliver() == 0 and receiver.seen()["attempts"] == {}
