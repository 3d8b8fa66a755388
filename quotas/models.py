from django.db import models
from django.db.models import Q


class QuotaPolicy(models.Model):
    """A limit on one dimension at one scope. `ai.concurrency` caps live slots (no window);
    `ai.tokens` and `ai.requests` cap usage per fixed UTC window. `subject` names the executor,
    team slug or username. The global scope's subject and a concurrency rule's window are stored as
    "" (not NULL) so the unique rule holds on every backend; the API shows them as null."""

    class Scope(models.TextChoices):
        GLOBAL = "global"
        EXECUTOR = "executor"
        TEAM = "team"
        USER = "user"

    class Dimension(models.TextChoices):
        CONCURRENCY = "ai.concurrency"
        TOKENS = "ai.tokens"
        REQUESTS = "ai.requests"

    class Window(models.TextChoices):
        MINUTE = "minute"
        HOUR = "hour"
        DAY = "day"
        MONTH = "month"

    scope = models.CharField(max_length=16, choices=Scope.choices)
    subject = models.CharField(max_length=150, blank=True, default="")
    dimension = models.CharField(max_length=32, choices=Dimension.choices)
    limit = models.PositiveBigIntegerField()
    window = models.CharField(max_length=16, choices=Window.choices, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "quota policies"
        ordering = ["dimension", "scope", "subject"]
        constraints = [
            models.UniqueConstraint(fields=["scope", "subject", "dimension", "window"], name="quotapolicy_unique_rule"),
            models.CheckConstraint(
                condition=Q(scope="global", subject="") | (~Q(scope="global") & ~Q(subject="")),
                name="quotapolicy_subject_matches_scope",
            ),
            models.CheckConstraint(
                condition=Q(dimension="ai.concurrency", window="") | (~Q(dimension="ai.concurrency") & ~Q(window="")),
                name="quotapolicy_window_matches_dimension",
            ),
        ]

    def __str__(self) -> str:
        where = f"{self.scope}:{self.subject}" if self.subject else self.scope
        per = f"/{self.window}" if self.window else ""
        return f"{self.dimension} {where} ≤ {self.limit}{per}"


class Usage(models.Model):
    """The usage ledger: what one subject used, and holds reserved, in one fixed UTC window of one
    budget rule's length. Written by quotas/budget.py only; read at submit and at every claim."""

    scope = models.CharField(max_length=16, choices=QuotaPolicy.Scope.choices)
    subject = models.CharField(max_length=150, blank=True, default="")
    window = models.CharField(max_length=16, choices=QuotaPolicy.Window.choices)
    window_start = models.DateTimeField()
    tokens = models.BigIntegerField(default=0)
    requests = models.BigIntegerField(default=0)
    # Estimates of attempts running now, settled to actual usage when each attempt ends.
    reserved_tokens = models.BigIntegerField(default=0)
    reserved_requests = models.BigIntegerField(default=0)
    # When a claim first found this subject out of budget in this window (its `deferred` event).
    exhausted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "usage"
        ordering = ["-window_start", "scope", "subject"]
        constraints = [
            models.UniqueConstraint(fields=["scope", "subject", "window", "window_start"], name="usage_unique_window")
        ]

    def __str__(self) -> str:
        who = f"{self.scope}:{self.subject}" if self.subject else self.scope
        since = f"{self.window_start:%Y-%m-%d %H:%M}"
        return f"{who} {self.window} from {since}: {self.tokens} tokens, {self.requests} requests"
