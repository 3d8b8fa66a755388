from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q

# Amounts of money (the `ai.cost` limit, the ledger's cost, a job's cost): exact decimals with 12
# places, enough for a price per million tokens with 6 places times one token.
MONEY_DIGITS, MONEY_PLACES = 32, 12
ZERO = Decimal(0)


def money_field(**options: Any) -> "models.DecimalField[Any, Any]":
    return models.DecimalField(max_digits=MONEY_DIGITS, decimal_places=MONEY_PLACES, **options)


class QuotaPolicy(models.Model):
    """A limit on one dimension at one scope. `ai.concurrency` caps live slots (no window);
    `ai.tokens`, `ai.requests` and `ai.cost` (money, in TELEMACHUS_CURRENCY) cap usage per fixed
    UTC window. `subject` names the executor, team slug, username or API key id. The global
    scope's subject and a concurrency rule's window are stored as "" (not NULL) so the unique rule
    holds on every backend; the API shows them as null. `limit` is a whole number except for
    `ai.cost`, whose limit is an amount."""

    class Scope(models.TextChoices):
        GLOBAL = "global"
        EXECUTOR = "executor"
        TEAM = "team"
        USER = "user"
        KEY = "key"

    class Dimension(models.TextChoices):
        CONCURRENCY = "ai.concurrency"
        TOKENS = "ai.tokens"
        REQUESTS = "ai.requests"
        COST = "ai.cost"

    class Window(models.TextChoices):
        MINUTE = "minute"
        HOUR = "hour"
        DAY = "day"
        MONTH = "month"

    scope = models.CharField(max_length=16, choices=Scope.choices)
    subject = models.CharField(max_length=150, blank=True, default="")
    dimension = models.CharField(max_length=32, choices=Dimension.choices)
    limit = money_field()
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
            models.CheckConstraint(condition=Q(limit__gte=0), name="quotapolicy_limit_not_negative"),
        ]

    def __str__(self) -> str:
        where = f"{self.scope}:{self.subject}" if self.subject else self.scope
        per = f"/{self.window}" if self.window else ""
        return f"{self.dimension} {where} ≤ {limit_text(self.dimension, self.limit)}{per}"


def limit_text(dimension: str, limit: Decimal | int) -> str:
    """A limit as people and the API read it: an amount for `ai.cost`, else a whole number."""
    if dimension == QuotaPolicy.Dimension.COST:
        return money_text(Decimal(limit))
    return str(int(limit))


def money_text(amount: Decimal) -> str:
    """An amount as a plain decimal string without trailing zeros ("0.0042", "12"), never in
    exponent form."""
    text = format(amount.normalize(), "f")
    return "0" if text in ("-0", "") else text


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
    # Money billed and held for attempts in flight (`ai.cost` budgets), in TELEMACHUS_CURRENCY.
    cost = money_field(default=ZERO)
    reserved_cost = money_field(default=ZERO)
    # When a claim first found this subject out of budget in this window (its `deferred` event).
    exhausted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "usage"
        ordering = ["-window_start", "scope", "subject"]
        constraints = [
            models.UniqueConstraint(fields=["scope", "subject", "window", "window_start"], name="usage_unique_window")
        ]
        # Retention deletes the windows that ended longest ago (scheduler/services/retention.py).
        # Written once per row, as its window opens: the counters' updates stay HOT.
        indexes = [models.Index("window_start", name="usage_window_start_idx")]

    def __str__(self) -> str:
        who = f"{self.scope}:{self.subject}" if self.subject else self.scope
        since = f"{self.window_start:%Y-%m-%d %H:%M}"
        return f"{who} {self.window} from {since}: {self.tokens} tokens, {self.requests} requests"


class Spend(models.Model):
    """What was spent, per UTC day, team, user and model: tokens and cost of every attempt that
    used tokens, for GET /api/spend/ and the cost metric. `key` is the API key the user is (an API
    key acts as a user of its own), kept for filtering. Written by quotas/budget.py only, as
    increments, with the usage ledger (lock level 4, after its rows)."""

    day = models.DateField()
    team = models.ForeignKey("telemachus.Team", on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.ForeignKey("telemachus.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    model = models.CharField(max_length=200)
    requests = models.BigIntegerField(default=0)
    # All tokens billed; of them, those known to be prompt or completion (a canceled attempt is
    # billed its estimate, whose split is not known).
    tokens = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    cost = money_field(default=ZERO)

    class Meta:
        verbose_name_plural = "spend"
        ordering = ["-day", "team", "user", "model"]
        constraints = [models.UniqueConstraint(fields=["day", "team", "user", "model"], name="spend_unique_day")]
        indexes = [
            models.Index("team", "day", name="spend_team_day_idx"),
            models.Index("key", "day", name="spend_key_day_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.team_id}/{self.user_id} {self.model}: {money_text(self.cost)}"
