import logging

from django.core.exceptions import ValidationError
from django.db import models

from executors.credentials import endpoint_problem, meta_problems, transport_credential_problems
from executors.prices import price_problems
from executors.simknobs import knob_problems
from executors.slurmtransport import transport_problems
from telemachus.models import Team

log = logging.getLogger("telemachus.executors")


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
        Team,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="executors",
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
    # What its models cost (executors/prices.py): {"<model>": {"input": "0.15", "output": "0.60"}},
    # per 1M tokens, in TELEMACHUS_CURRENCY.
    prices = models.JSONField(
        default=dict, blank=True, help_text='{"<model>": {"input": "<per 1M tokens>", "output": "<per 1M tokens>"}}'
    )
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

    @classmethod
    def from_db(cls, db: str | None, field_names: list[str], values: list) -> "Executor":  # type: ignore[override]
        """Loaded rows are never trusted to have the shapes the API enforces: an executor whose
        capabilities, transport or meta is not an object (edited by SQL, say) would otherwise crash
        every claim and the queue page. Such a value is logged once and read as empty (the
        executor then offers no model), so the rest of the cluster keeps working."""
        executor = super().from_db(db, field_names, values)
        for name, problem in json_shape_problems(executor, loaded=field_names).items():
            key = (executor.pk, name, repr(getattr(executor, name.split(".")[0]))[:200])
            if name == "capabilities.models":
                executor.capabilities = {**executor.capabilities, "models": []}
            else:
                setattr(executor, name, {})
            if key not in _reported:
                _reported.add(key)
                log.error("executor %s: stored %s %s; read as empty until it is fixed", executor.name, name, problem)
        return executor

    def clean(self) -> None:
        """The admin's form: the shapes from_db would otherwise discard, a sim executor's knobs
        within their bounds, an hpc-partition's transport, and no secret outside the places for
        credentials (as the API checks them; executors/credentials.py)."""
        problems = json_shape_problems(self, loaded=[f.attname for f in self._meta.concrete_fields])
        if problems:
            raise ValidationError({name.split(".")[0]: f"{name} {problem}" for name, problem in problems.items()})
        if problem := endpoint_problem(self.endpoint):
            raise ValidationError({"endpoint": problem})
        if secrets := meta_problems(self.meta):
            raise ValidationError({"meta": [f"meta.{path} {problem}" for path, problem in secrets.items()]})
        stored = Executor.objects.filter(pk=self.pk).values_list("transport", flat=True).first() if self.pk else None
        if secrets := transport_credential_problems(self.transport, stored=stored):
            raise ValidationError({"transport": [f"transport.{path} {problem}" for path, problem in secrets.items()]})
        if self.kind == "sim" and (knobs := knob_problems(self.meta)):
            raise ValidationError({"meta": [f"meta.{name} {problem}" for name, problem in knobs.items()]})
        if priced := price_problems(self.prices):
            raise ValidationError({"prices": [f"{model} {problem}" for model, problem in priced.items()]})
        if self.kind == "hpc-partition" and (problems := transport_problems(self.transport)):
            raise ValidationError({"transport": [f"transport.{name} {problem}" for name, problem in problems.items()]})


_reported: set[tuple] = set()


def json_shape_problems(executor: Executor, *, loaded: list[str]) -> dict[str, str]:
    """The JSON fields of an executor that do not have the shape the scheduler reads."""
    problems = {}
    for name in ("capabilities", "transport", "meta", "prices"):
        if name in loaded and not isinstance(getattr(executor, name), dict):
            problems[name] = "is not an object"
    if "capabilities" in loaded and "capabilities" not in problems:
        models = executor.capabilities.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            problems["capabilities.models"] = "is not a list of model names"  # type: ignore[index]
    return problems  # type: ignore[return-value]


class ModelRoute(models.Model):
    """A public model name that stands for an ordered list of models (issue #39): apps call `name`
    on every surface; a job on the route runs on the first model that can take it and falls back
    to the next when that one's executors are down or their breakers open, when it failed there
    after its retries, when its prompt does not fit the model's context window, or when its queue
    deadline passed (scheduler/services/routes.py). Configuration: read from the configuration cache
    and watched by its version triggers (migration 0009); edits go through executors/routes.py,
    which audits them."""

    name = models.CharField(max_length=200, unique=True, help_text="The name apps call, as a model name.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Last: the field's name hides the module's within the class body.
    models = models.JSONField(
        default=list, help_text='The models it stands for, in the order they are tried: ["model-a", "model-b"].'
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} → {', '.join(self.models)}"

    def clean(self) -> None:
        if problem := route_models_problem(self.name, self.models):
            raise ValidationError({"models": problem})


# The most models one route may list.
MAX_ROUTE_MODELS = 16


def route_models_problem(name: str, models: object) -> str | None:
    """What is wrong with a route's model list, if anything: a list of 1 to MAX_ROUTE_MODELS
    distinct model names, not the route's own name."""
    if not isinstance(models, list) or not 1 <= len(models) <= MAX_ROUTE_MODELS:
        return f"A list of 1 to {MAX_ROUTE_MODELS} model names."
    if not all(isinstance(m, str) and m and len(m) <= 200 for m in models):
        return "Each model is a non-empty name of at most 200 characters."
    if len(set(models)) != len(models):
        return "Each model at most once."
    if name in models:
        return "A route cannot list itself."
    return None
