"""Sending the outbox: `webhooks_deliver`, run by every worker's webhook task (scheduler/worker/
runner.py) on a thread of its own, never on the threads that claim and finish jobs.

One call takes up to `limit` due deliveries in a short transaction of its own (SKIP LOCKED on the
delivery rows, lock level 7: several workers take different rows and never wait for each other),
moving each one's next attempt past a lease so nobody else takes it while it is in flight; commits;
sends them at once, each on its own thread, outside any transaction, each bounded by
TELEMACHUS_WEBHOOKS_TIMEOUT_SECONDS; then records every attempt in a second short transaction. A
slow or failing receiver holds up only its own delivery.

Each attempt is signed per the Standard Webhooks specification (`webhook-id`: the delivery's
message id, the same on every attempt; `webhook-timestamp`: the attempt's time; `webhook-signature`:
`v1,` and the HMAC-SHA256 of `id.timestamp.body` under the webhook's secret, by the
`standardwebhooks` package). A 2xx answer delivers it; anything else (another status, a refused
address, a timeout, a connection error) is retried after an exponential, jittered backoff until
TELEMACHUS_WEBHOOKS_MAX_ATTEMPTS or TELEMACHUS_WEBHOOKS_MAX_AGE_SECONDS, then it is `failed`.

A worker that dies between taking and recording leaves the delivery due again when its lease ends:
delivery is at least once, and receivers drop repeats by `webhook-id`, as the specification says."""

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from standardwebhooks.webhooks import Webhook as Signer

from telemachus.db.locks import Level, rows_lock
from telemachus.webhooks.addresses import AddressRefused, host_header, webhook_target
from telemachus.webhooks.models import WebhookAttempt, WebhookDelivery

EXCERPT_BYTES = 500
USER_AGENT = "Telemachus-Webhooks/1"
# At most this many attempts of one call run at once.
SENDERS = 8


@dataclass(frozen=True)
class AttemptOutcome:
    delivery_id: int
    attempt: int  # the delivery's attempt number this was (it fences the record)
    at: datetime
    duration_ms: int
    status_code: int | None = None
    excerpt: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def webhook_retry_delay(*, attempt: int) -> float:
    """Seconds before the next attempt after `attempt` failed ones: exponential, capped, with
    jitter over the upper half, so the retries of a burst spread out."""
    cap = min(
        settings.TELEMACHUS_WEBHOOKS_RETRY_MAX_SECONDS,
        settings.TELEMACHUS_WEBHOOKS_RETRY_BASE_SECONDS * 2 ** max(attempt - 1, 0),
    )
    return random.uniform(cap / 2, cap)


def _lease() -> timedelta:
    """How long a taken delivery is not due for anyone else: well past one attempt's bound."""
    return timedelta(seconds=max(60.0, 4 * settings.TELEMACHUS_WEBHOOKS_TIMEOUT_SECONDS))


def deliveries_take(*, limit: int) -> list[WebhookDelivery]:
    """Take up to `limit` due deliveries of enabled webhooks, oldest due first: count the attempt
    and push the next one a lease away. A read first, outside any transaction, so an empty outbox
    costs one indexed query and no write lock (SQLite serializes writers). Then a durable
    transaction that locks only the rows it takes (SKIP LOCKED, level 7)."""
    now = timezone.now()
    due = WebhookDelivery.objects.filter(
        status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now, webhook__enabled=True
    )
    if not due.exists():
        return []
    with transaction.atomic(durable=True):
        taken = list(
            rows_lock(due, level=Level.WEBHOOK_DELIVERY, skip_locked=True, of=("self",))
            .select_related("webhook")
            .order_by("next_attempt_at", "id")[:limit]
        )
        lease_end = now + _lease()
        for delivery in taken:
            delivery.attempts += 1
            delivery.next_attempt_at = lease_end
        WebhookDelivery.objects.bulk_update(taken, ["attempts", "next_attempt_at"])
    return taken


def delivery_attempt(delivery: WebhookDelivery, *, client: httpx.Client) -> AttemptOutcome:
    """Send one delivery once, as it stands (no database access: safe on any thread). The URL is
    resolved and checked again here, and the request goes to the address that was checked."""
    started, at = time.monotonic(), timezone.now()

    def outcome(**fields: object) -> AttemptOutcome:
        duration = int((time.monotonic() - started) * 1000)
        return AttemptOutcome(delivery.pk, delivery.attempts, at, duration, **fields)  # type: ignore[arg-type]

    webhook = delivery.webhook
    try:
        target = webhook_target(webhook.url, allow_private=settings.TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE)
    except AddressRefused as exc:
        return outcome(error=f"not sent: {exc}"[:500])
    body = json.dumps(delivery.payload, separators=(",", ":"), ensure_ascii=False).encode()
    signature = Signer(webhook.secret).sign(msg_id=delivery.message_id, timestamp=at, data=body)
    headers = {
        "Host": host_header(webhook.url),
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "webhook-id": delivery.message_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": signature,
    }
    deadline = started + settings.TELEMACHUS_WEBHOOKS_TIMEOUT_SECONDS
    try:
        with client.stream(
            "POST", target.url, content=body, headers=headers, extensions={"sni_hostname": target.host}
        ) as response:
            excerpt = b""
            for chunk in response.iter_raw():
                excerpt += chunk
                if len(excerpt) >= EXCERPT_BYTES or time.monotonic() > deadline:
                    break
            return outcome(
                status_code=response.status_code,
                excerpt=excerpt[:EXCERPT_BYTES].decode("utf-8", "replace"),
            )
    except httpx.HTTPError as exc:
        return outcome(error=f"{type(exc).__name__}: {exc}"[:500] or type(exc).__name__)


def deliveries_record(*, outcomes: list[AttemptOutcome]) -> None:
    """Keep each attempt, and move its delivery on: delivered on a 2xx; failed when out of
    attempts or too old; else due again after the backoff. A delivery taken again since (its
    lease ran out first) has a later attempt number, and is left to that attempt."""
    if not outcomes:
        return
    max_attempts = settings.TELEMACHUS_WEBHOOKS_MAX_ATTEMPTS
    max_age = timedelta(seconds=settings.TELEMACHUS_WEBHOOKS_MAX_AGE_SECONDS)
    with transaction.atomic(durable=True):
        WebhookAttempt.objects.bulk_create(
            WebhookAttempt(
                delivery_id=o.delivery_id,
                at=o.at,
                duration_ms=o.duration_ms,
                status_code=o.status_code,
                response_excerpt=o.excerpt,
                error=o.error,
            )
            for o in outcomes
        )
        created = dict(
            WebhookDelivery.objects.filter(pk__in=[o.delivery_id for o in outcomes]).values_list("pk", "created_at")
        )
        for o in outcomes:
            current = WebhookDelivery.objects.filter(
                pk=o.delivery_id, attempts=o.attempt, status=WebhookDelivery.Status.PENDING
            )
            if o.ok:
                current.update(status=WebhookDelivery.Status.DELIVERED, delivered_at=o.at)
                continue
            retry_at = timezone.now() + timedelta(seconds=webhook_retry_delay(attempt=o.attempt))
            if o.attempt >= max_attempts or o.delivery_id not in created or retry_at - created[o.delivery_id] > max_age:
                current.update(status=WebhookDelivery.Status.FAILED)
            else:
                current.update(next_attempt_at=retry_at)


def webhooks_deliver(*, limit: int = 32) -> int:
    """Take due deliveries, send them, record the outcomes (see the module's docstring). Returns
    how many it took: `limit` says more may be due now. Must not run inside a transaction; takes
    about one attempt's time at most (each attempt is bounded by the timeout)."""
    taken = deliveries_take(limit=limit)
    if not taken:
        return 0
    timeout = settings.TELEMACHUS_WEBHOOKS_TIMEOUT_SECONDS
    # No proxies from the environment (the address checked is the address connected to), no
    # redirects (a redirect could point anywhere).
    with (
        httpx.Client(timeout=httpx.Timeout(timeout), follow_redirects=False, trust_env=False) as client,
        ThreadPoolExecutor(max_workers=min(len(taken), SENDERS), thread_name_prefix="telemachus-webhook") as senders,
    ):
        outcomes = list(senders.map(lambda delivery: delivery_attempt(delivery, client=client), taken))
    deliveries_record(outcomes=outcomes)
    return len(taken)
