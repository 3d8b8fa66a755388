from django.db import models

from telemachus.models import Team


class Executor(models.Model):
    """A place where work runs. The scheduler reads only capabilities, capacity and health; the driver
    named by `kind` does the rest (see executors/contract.py)."""

    class Health(models.TextChoices):
        OK = "ok"
        DEGRADED = "degraded"
        DOWN = "down"

    class Breaker(models.TextChoices):
        CLOSED = "closed"
        OPEN = "open"
        HALF_OPEN = "half_open"

    team = models.ForeignKey(
        Team, null=True, blank=True, on_delete=models.CASCADE, related_name="executors",
        help_text="Owning team; empty means shared by every team.",
    )
    kind = models.CharField(max_length=32)
    name = models.SlugField(max_length=64, unique=True)
    endpoint = models.URLField(max_length=500, null=True, blank=True)
    capabilities = models.JSONField(default=dict, blank=True, help_text='{"models": [...], "class": "gpu"}')
    max_concurrency = models.PositiveIntegerField(default=4)
    enabled = models.BooleanField(default=True)
    health = models.CharField(max_length=16, choices=Health.choices, default=Health.OK)
    last_seen = models.DateTimeField(null=True, blank=True, help_text="Last successful contact (probe or dispatch).")
    last_probed_at = models.DateTimeField(null=True, blank=True)
    # Passive circuit breaker, shared by every worker: open after consecutive dispatch failures,
    # out of placement until `breaker_until`, then one trial request (half open) decides.
    breaker = models.CharField(max_length=16, choices=Breaker.choices, default=Breaker.CLOSED)
    consecutive_failures = models.PositiveIntegerField(default=0)
    breaker_until = models.DateTimeField(null=True, blank=True)
    weight = models.PositiveIntegerField(default=1)
    transport = models.JSONField(default=dict, blank=True)
    meta = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        # A team-owned executor serves its own team, and teams whose group is granted this on it.
        permissions = [("use_executor", "Place this team's jobs on the executor")]

    def __str__(self) -> str:
        return self.name

    @property
    def offered_models(self) -> list[str]:
        return list(self.capabilities.get("models") or [])
