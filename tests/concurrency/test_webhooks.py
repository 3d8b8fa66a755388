"""Webhook deliveries with two worker processes taking from one outbox (SKIP LOCKED): every event
reaches the receiver, verified, exactly once; the failed jobs among them were failed by the same
workers, whose queue went on while they delivered."""

from collections import Counter

import pytest
from django.db import transaction

from executors.models import Executor
from scheduler.models import Job
from scheduler.services.submit import job_submit
from telemachus.models import WebhookDelivery
from telemachus.webhooks.services import WebhookEvent, webhook_create, webhooks_emit
from tests.processes import wait_until
from tests.telemachus.webhooks.conftest import private_allowed, receiver  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WORKER_ENV = {"TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE": "1", "TELEMACHUS_WEBHOOKS_POLL_SECONDS": "0.05"}


def test_two_workers_deliver_each_event_once(processes, receiver, private_allowed, member_setup):  # noqa: F811
    # Given team a's webhook, a receiver that takes a moment per delivery, 30 events in the outbox
    # and 10 jobs on an executor that fails every call...
    alice, _, team_a, _, executor = member_setup
    webhook, secret = webhook_create(team=team_a, url=receiver.url, events=["job.failed", "batch.completed"])
    receiver.configure(secret=secret, delay=0.1)
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 0, "fail_rate": 1})
    with transaction.atomic():
        webhooks_emit(
            events=[
                WebhookEvent(type="batch.completed", data={"n": n}, teams=frozenset({team_a.pk})) for n in range(30)
            ]
        )
    jobs = [
        job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "x"}]},
        )
        for _ in range(10)
    ]

    # When two workers run...
    for name in ("w1", "w2"):
        processes.worker(name, concurrency=4, **WORKER_ENV)

    # Then every job failed, and every event was delivered once, its signature verified.
    wait_until(
        lambda: WebhookDelivery.objects.filter(status="delivered").count() == 40,
        timeout=60,
        interval=0.1,
        what="40 deliveries",
    )
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("status", flat=True)) == {"failed"}
    seen = receiver.seen()
    assert seen["rejected"] == 0 and len(seen["accepted"]) == 40
    assert set(Counter(seen["attempts"].values())) == {1}, "a message was sent more than once"
    assert Counter(a["type"] for a in seen["accepted"]) == {"batch.completed": 30, "job.failed": 10}
    assert {a["data"]["job"]["id"] for a in seen["accepted"] if a["type"] == "job.failed"} == {j.pk for j in jobs}
    assert set(WebhookDelivery.objects.values_list("attempts", flat=True)) == {1}
