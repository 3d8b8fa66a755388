"""Webhooks: a team's receivers of the events it must act on, and the outbox of their deliveries.

A delivery row is written in the transaction of the change it reports (a budget settled past a
threshold, a breaker opened, a job failed for good), so a rolled-back change sends nothing and a
crash loses nothing: the delivery loop (telemachus/webhooks/delivery.py) sends what the outbox
holds, outside every transaction of the queue, and keeps each attempt's outcome for the team to
read."""

from django.conf import settings
from django.db import models
from django.db.models import Q

from telemachus.models import Team


class Webhook(models.Model):
    """Where a team wants some event types delivered, signed per the Standard Webhooks
    specification with `secret` (`whsec_` and base64 of 32 random bytes). The secret is stored as
    it is, since every delivery is signed with it; the API shows it in the creating answer only."""

    class Event(models.TextChoices):
        BUDGET_THRESHOLD = "budget.threshold", "a budget reached 80 % of its limit"
        BUDGET_EXHAUSTED = "budget.exhausted", "a budget reached its limit"
        EXECUTOR_DOWN = "executor.down", "an executor's probe found it down"
        EXECUTOR_UP = "executor.up", "an executor that was down answers again"
        BREAKER_OPENED = "breaker.opened", "an executor's circuit breaker opened"
        JOB_FAILED = "job.failed", "a job failed for good (no attempt left)"
        BATCH_COMPLETED = "batch.completed", "a batch of jobs finished"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="webhooks")
    url = models.URLField(max_length=2000)
    events = models.JSONField(default=list)
    description = models.CharField(max_length=200, blank=True, default="")
    secret = models.CharField(max_length=100)
    enabled = models.BooleanField(default=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team", "-id"]

    def __str__(self) -> str:
        return f"webhook {self.pk} of {self.team} to {self.url}"


class WebhookDelivery(models.Model):
    """One event for one webhook: its body, and where its delivery stands. `pending` rows whose
    `next_attempt_at` has come are due; the loop that takes one moves `next_attempt_at` past its
    attempt (a lease), so a worker that dies mid-attempt leaves it due again later, never lost."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    # The Standard Webhooks `webhook-id`: the same on every attempt, so a receiver drops repeats.
    message_id = models.CharField(max_length=40, unique=True)
    event = models.CharField(max_length=32)
    payload = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index("next_attempt_at", name="webhookdelivery_due_idx", condition=Q(status="pending")),
            models.Index("webhook", "id", name="webhookdelivery_hook_idx"),
            # Retention deletes the deliveries sent or given up on longest ago, oldest first.
            models.Index("created_at", name="webhookdelivery_created_idx", condition=~Q(status="pending")),
        ]

    def __str__(self) -> str:
        return f"{self.event} {self.message_id} ({self.status})"


class WebhookAttempt(models.Model):
    """One try at delivering: when, how long, and what the receiver answered (its status and the
    start of its body), or why nothing was sent or answered (`error`)."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField(default=0)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response_excerpt = models.CharField(max_length=500, blank=True, default="")
    error = models.CharField(max_length=500, blank=True, default="")

    class Meta:
        ordering = ["delivery", "id"]

    def __str__(self) -> str:
        return f"attempt at {self.at:%Y-%m-%d %H:%M:%S}: {self.status_code or self.error}"
