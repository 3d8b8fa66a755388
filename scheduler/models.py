from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from executors.models import Executor
from quotas.concurrency import SlotCounts
from quotas.models import ZERO, money_field
from telemachus.models import ApiKey, Team


class Job(models.Model):
    """One unit of AI work. Status moves queued → running → done | failed | canceled (and running →
    queued on recovery); every move goes through a service in scheduler/services/ that writes the
    matching JobEvent in the same transaction.

    While running, `lease` is the token of the claim that took the job: heartbeats, steps, finish and
    release all name the job and its lease in their WHERE clause (the fencing token is the pair; jobs
    claimed together share a token), and it dies at `lease_expires_at` (database clock) unless the
    holder renews it."""

    class Type(models.TextChoices):
        CHAT = "chat"
        TRANSLATE = "translate"
        FLOW = "flow"
        TASK = "task"
        TOOL = "tool"
        # A slot held by app code that runs its own model call (scheduler/flows/governed.py): queued and
        # claimed like a flow's round, never dispatched by a worker.
        GOVERNED = "governed", "Governed slot"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"
        CANCELED = "canceled"

    TERMINAL = (Status.DONE, Status.FAILED, Status.CANCELED)
    PRIORITY_MIN, PRIORITY_MAX = -100, 100

    type = models.CharField(max_length=16, choices=Type.choices)
    # No index of their own: job_user_status_idx and job_team_status_idx start with them (Meta).
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs", db_index=False)
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="jobs", db_index=False)
    priority = models.SmallIntegerField(default=0)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    requirements = models.JSONField(default=dict)
    # requirements["model"], copied into a column so the claim can filter and index on it.
    model = models.CharField(max_length=200)
    executor = models.ForeignKey(
        Executor, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs", db_index=False
    )
    cost_estimate = models.PositiveBigIntegerField(default=0)
    # The estimate split for pricing: the prompt's counted tokens, and the completion's (max_tokens,
    # or what est_tokens leaves after the prompt). With the executor's prices it is the money
    # reserved against `ai.cost` budgets (scheduler/core/money.py).
    est_prompt_tokens = models.PositiveBigIntegerField(default=0)
    est_completion_tokens = models.PositiveBigIntegerField(default=0)
    # What its attempts cost, all told (tokens x the executor's prices), in TELEMACHUS_CURRENCY.
    cost = money_field(default=ZERO)
    # The app key that submitted it (its `user` is then the key's own user): telemachus/keys/.
    key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs", db_index=False
    )
    parent_flow = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children", db_index=False
    )
    submitted_at = models.DateTimeField(default=timezone.now)
    # Its place in line within a priority: when it became ready to run. Set at submit; a flow's
    # next round becomes ready when the previous one ends (QueuePolicy.flow_rounds = requeue), or
    # keeps the flow's place (continue). Ties go to the lower id.
    ready_at = models.DateTimeField(default=timezone.now)
    # When it last entered the queue (its submit, or its flow's latest round): the starvation
    # guard counts a wait from here, so a flow that has been served round after round does not
    # age past newer work, whichever way its place in line is kept.
    queued_at = models.DateTimeField(default=timezone.now)
    # When it first started (a flow: its first round; a retry is not a new start). The start of the
    # attempt or round running now is its slot's `acquired_at`; per-round starts are in the events.
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    tokens_used = models.PositiveBigIntegerField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    input = models.JSONField(default=dict)
    result = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    # Token budget held for the running attempt: {"tokens": N, "keys": [[scope, subject, window,
    # window_start], ...]}, released or settled to actual usage when the attempt ends.
    reservation = models.JSONField(null=True, blank=True)
    # End of the budget window this job was last deferred for, so a deferral is recorded once.
    deferred_until = models.DateTimeField(null=True, blank=True)
    # A retry waits until `run_after` and prefers an executor other than the one that failed.
    run_after = models.DateTimeField(null=True, blank=True)
    avoid_executor = models.ForeignKey(
        Executor, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    # Round affinity (QueuePolicy.affinity): the executor this job's next start prefers, whose
    # model server may still hold the prefix cache of the conversation so far. A flow's next round
    # prefers the executor that served its last one; a /v1/ call that continues a session
    # (`affinity_key`, from X-Telemachus-Session) prefers the one that served the session's last call.
    affinity_executor = models.ForeignKey(
        Executor, null=True, blank=True, on_delete=models.SET_NULL, related_name="+", db_index=False
    )
    affinity_key = models.CharField(max_length=200, blank=True, default="")
    meta = models.JSONField(default=dict, blank=True)
    # A flow's durable state between rounds: rounds finished, and the messages they added after
    # input.messages (assistant replies, tool results). Written by scheduler/services/rounds.py.
    rounds = models.PositiveIntegerField(default=0)
    conversation = models.JSONField(default=list, blank=True)
    worker = models.CharField(max_length=200, blank=True, default="")
    # No index: every statement that names a lease names its jobs' ids too (the fencing pair).
    lease = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            # The claim reads each team's head of line: highest priority, then first ready.
            models.Index(
                "team",
                models.F("priority").desc(),
                "ready_at",
                "id",
                name="job_team_ready_idx",
                condition=Q(status="queued"),
            ),
            models.Index(
                models.F("priority").desc(), "ready_at", "id", name="job_ready_idx", condition=Q(status="queued")
            ),
            # Tool jobs take no executor slot; the claim reads them apart (services/tooljobs.py).
            models.Index(
                models.F("priority").desc(),
                "ready_at",
                "id",
                name="job_tool_queue_idx",
                condition=Q(status="queued", type="tool"),
            ),
            # Recovery scans running jobs whose lease ran out.
            models.Index("lease_expires_at", name="job_lease_idx", condition=Q(status="running")),
            # The starvation guard also looks at each team's longest-waiting queued jobs.
            models.Index("team", "queued_at", "id", name="job_team_wait_idx", condition=Q(status="queued")),
            models.Index("team", "status", name="job_team_status_idx"),
            # A claim that leaves work behind asks when the next retry's backoff ends.
            models.Index("run_after", name="job_retry_idx", condition=Q(status="queued", run_after__isnull=False)),
            models.Index("user", "status", name="job_user_status_idx"),
            # A /v1/ call continuing a session looks up the session's last call in its team.
            models.Index(
                "team", "affinity_key", models.F("id").desc(), name="job_affinity_idx", condition=~Q(affinity_key="")
            ),
            # Foreign keys a submit leaves empty (but for a key or a session's executor), indexed
            # only where set, so a submit's insert writes no entry in them: every read that uses
            # them asks for a value (an executor's jobs on the dashboard, a revoked key's queued
            # jobs), and so do the deletes that cascade or set them null (an executor's, a key's, a
            # flow's).
            models.Index("executor", name="job_executor_idx", condition=Q(executor__isnull=False)),
            models.Index("key", name="job_key_idx", condition=Q(key__isnull=False)),
            models.Index("parent_flow", name="job_parent_flow_idx", condition=Q(parent_flow__isnull=False)),
            models.Index("avoid_executor", name="job_avoid_executor_idx", condition=Q(avoid_executor__isnull=False)),
            models.Index(
                "affinity_executor", name="job_affinity_executor_idx", condition=Q(affinity_executor__isnull=False)
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=(Q(status="running") & Q(lease__isnull=False) & Q(lease_expires_at__isnull=False))
                | (~Q(status="running") & Q(lease__isnull=True)),
                name="job_lease_iff_running",
            ),
            models.CheckConstraint(condition=Q(priority__gte=-100) & Q(priority__lte=100), name="job_priority_range"),
        ]
        permissions = [("manage", "Operate the scheduler (teams, executors, quotas, policy, every job)")]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.type}, {self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL

    @property
    def current_round(self) -> int | None:
        """A flow's round: the one it runs or waits for, or its last once ended (None: not a flow)."""
        if self.type not in (self.Type.FLOW, self.Type.GOVERNED):
            return None
        return self.rounds if self.is_terminal else self.rounds + 1

    @property
    def round_label(self) -> str:
        """The same for people: "round 3", "round 3 next" (queued between rounds), "12 rounds"."""
        if self.current_round is None:
            return ""
        if self.is_terminal:
            return f"{self.rounds} round{'' if self.rounds == 1 else 's'}"
        return f"round {self.current_round}" + (" next" if self.status == self.Status.QUEUED and self.rounds else "")

    # Fields `end` changes, for the callers' saves and bulk updates.
    END_FIELDS = (
        "status",
        "result",
        "error",
        "finished_at",
        "tokens_used",
        "cost",
        "lease",
        "lease_expires_at",
        "reservation",
    )

    def end(
        self, *, status: str, at: datetime, result: dict[str, Any] | None = None, error: str = "", tokens: int = 0
    ) -> None:
        """running or queued → done, failed or canceled (not saved: callers batch writes). The one
        place a job's end is written, whichever service ends it (finish, a flow's round, cancel,
        recovery): its status and time, its result or error, the tokens of the attempt that ends
        it added to `tokens_used`; the lease and the budget reservation go (the caller settles the
        reservation in the ledger: scheduler/services/attempts.py)."""
        assert status in self.TERMINAL, f"{status} is not an end"
        assert not self.is_terminal, f"job {self.pk} already ended {self.status}"
        self.status = status
        self.finished_at = at
        self.result = result
        self.error = error
        self.tokens_used = (self.tokens_used or 0) + tokens
        self.lease = None
        self.lease_expires_at = None
        self.reservation = None

    # Fields `return_to_queue` changes, for bulk_update by its callers.
    REQUEUE_FIELDS = ("status", "executor", "lease", "lease_expires_at", "attempts", "reservation")

    def return_to_queue(self) -> None:
        """running → queued, dropping the lease, placement and budget reservation (not saved:
        callers batch writes, and release the reservation in the ledger). `started_at` stays when
        the job first started: a flow's next round or a retry is not a new start."""
        assert self.status == self.Status.RUNNING, f"job {self.pk} is {self.status}, not running"
        self.status = self.Status.QUEUED
        self.executor = None
        self.lease = None
        self.lease_expires_at = None
        self.reservation = None


class JobEvent(models.Model):
    """Append-only audit and observability log. Most events belong to a job; executor events
    (breaker transitions, health changes) have no job; policy edits are in the audit log. Written only by services
    (scheduler/services/events.py), in the transaction of the change they describe."""

    class Type(models.TextChoices):
        QUEUED = "queued"
        PLACED = "placed"
        STARTED = "started"
        STEP = "step"
        FINISHED = "finished"
        FAILED = "failed"
        CANCELED = "canceled"
        REQUEUED = "requeued"
        # A flow's rounds (and a governed slot's one round): started, finished with its tokens
        # and the tools it called.
        ROUND_STARTED = "round_started"
        ROUND_FINISHED = "round_finished"
        PRIORITY_CLAMPED = "priority_clamped"
        RETRY_SCHEDULED = "retry_scheduled"
        DEFERRED = "deferred"
        FINISH_REFUSED = "finish_refused"
        # Executor events (no job).
        BREAKER_OPENED = "breaker_opened"
        BREAKER_HALF_OPEN = "breaker_half_open"
        BREAKER_CLOSED = "breaker_closed"
        HEALTH_CHANGED = "health_changed"

    # Indexed by jobevent_job_idx and jobevent_executor_idx (Meta), not each on its own. No
    # database constraint on the job (db_constraint): events are written by the services of their
    # job (in the transaction that inserts or locks it, or a driver's `step` of a running job), and
    # jobs are never deleted but through Django, which deletes their events first; the constraint's
    # check at each commit was PostgreSQL work on every event (Slot).
    job = models.ForeignKey(
        Job,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="events",
        db_index=False,
        db_constraint=False,
    )
    executor = models.ForeignKey(
        Executor, null=True, blank=True, on_delete=models.SET_NULL, related_name="events", db_index=False
    )
    event = models.CharField(max_length=32, choices=Type.choices)
    at = models.DateTimeField(default=timezone.now)
    meta = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index("job", "id", name="jobevent_job_idx"),
            # Executor events and an executor's delete (which sets its events' executor null) ask
            # for one executor; a job's `queued` event names none.
            models.Index("executor", name="jobevent_executor_idx", condition=Q(executor__isnull=False)),
            # Reads by kind and time (the history's ends and starts, the dashboard's rounds, the
            # admin's filter) never ask for `queued` events, a submit's one event.
            models.Index("event", "at", name="jobevent_event_idx", condition=~Q(event="queued")),
        ]

    def __str__(self) -> str:
        return f"{self.event} job={self.job_id} at {self.at:%Y-%m-%d %H:%M:%S}"


class Slot(models.Model):
    """One unit of executor capacity held by one step of a running job. In-use counts at every scope
    are counted from these rows (never from counters that can drift). A slot lives exactly as long
    as its job's lease: recovery deletes the slots of jobs whose lease expired.

    Its references carry no database constraints (db_constraint): the claim, the only writer, copies
    them from the job it locks and marks running in the same transaction (its team, its user, the
    executor it sets on the job), so the job's own constraints hold them, and Django still applies
    `on_delete` (PROTECT: an executor, team or user with slots cannot be deleted). Checked at every
    claim's commit, the four cost PostgreSQL a lookup and a KEY SHARE row lock each (the team and
    user rows every concurrent claim of a team shares; the executor's is still taken by the job's
    own reference): with the events' job reference, about half of the constraint checks of one
    /v1/ call."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="slots", db_constraint=False)
    executor = models.ForeignKey(Executor, on_delete=models.PROTECT, related_name="slots", db_constraint=False)
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="slots", db_constraint=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="slots", db_constraint=False
    )
    worker = models.CharField(max_length=200)
    acquired_at = models.DateTimeField()

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"slot {self.pk} job={self.job_id} on {self.executor_id}"


class QueuePolicy(models.Model):
    """The operator-editable policy record; a singleton (pk=1). Its row is also the global claim lock:
    every transaction that creates slots locks it first (see scheduler/core/locks.py), so an edit applies
    to the next claim. Edits go through scheduler/services/policy.py, which audits them."""

    # Not columns: read with the claim lock and set on the copy lock_claim returns (scheduler/core/locks.py).
    config_version: int
    next_retry: datetime | None
    tools_queued: bool
    slot_counts: "SlotCounts"  # only when the claim asks for them with the lock

    class Placement(models.TextChoices):
        LEAST_LOADED = "least-loaded"
        PACK = "pack"
        WEIGHTED = "weighted"

    class Recovery(models.TextChoices):
        REQUEUE = "requeue"
        FAIL = "fail"

    class Cost(models.TextChoices):
        SLOT_SECONDS = "slot-seconds"
        TOKENS = "tokens"

    class OverLimit(models.TextChoices):
        CLAMP = "clamp"
        REJECT = "reject"

    class FlowRounds(models.TextChoices):
        REQUEUE = "requeue"
        CONTINUE = "continue"

    class Affinity(models.TextChoices):
        OFF = "off"
        PREFER = "prefer"

    SINGLETON_ID = 1
    DEFAULT_MAX_QUEUE_DEPTH = 10_000

    # Weighted fair share across teams, within a priority.
    team_weights = models.JSONField(
        default=dict, blank=True, help_text='{"<team slug>": weight}; 0 = spare capacity only'
    )
    default_weight = models.FloatField(default=1.0)
    cost = models.CharField(max_length=16, choices=Cost.choices, default=Cost.SLOT_SECONDS)
    half_life_seconds = models.FloatField(default=300.0, help_text="Half-life of past usage in the fair-share key.")
    entry_penalty = models.FloatField(
        default=1.0,
        help_text="Charged to a team's usage when one of its jobs starts (slot-seconds; tokens: the estimate).",
    )
    # Starvation guard: a queued job gains one priority level per step after waiting, up to the boost.
    aging_after_seconds = models.FloatField(default=300.0)
    aging_step_seconds = models.FloatField(default=60.0)
    aging_max_boost = models.PositiveSmallIntegerField(default=10)
    # Admission.
    max_queue_depth = models.JSONField(default=dict, blank=True, help_text='{"default": N, "<team slug>": N}')
    priority_map = models.JSONField(
        default=dict,
        blank=True,
        help_text='Highest priority allowed: {"member": 0, "manager": 10, "team:<slug>": N, "user:<name>": N}',
    )
    priority_over_limit = models.CharField(max_length=8, choices=OverLimit.choices, default=OverLimit.CLAMP)
    # Placement and recovery.
    placement = models.CharField(max_length=16, choices=Placement.choices, default=Placement.LEAST_LOADED)
    recovery = models.CharField(max_length=16, choices=Recovery.choices, default=Recovery.REQUEUE)
    max_attempts = models.PositiveSmallIntegerField(default=3)
    # A flow's next round: `requeue` queues it behind work that became ready while its last round
    # ran (other jobs run between rounds); `continue` keeps the flow's place in line, ahead of
    # newer work of its priority and team. Either way it meets caps, priority and fair share.
    flow_rounds = models.CharField(max_length=16, choices=FlowRounds.choices, default=FlowRounds.REQUEUE)
    # Round affinity: `prefer` places a job on its preferred executor (Job.affinity_executor) when
    # that executor is among those with a free slot under every cap; it never changes which job
    # goes next. When it is full, the job takes another executor at once, or, with
    # `affinity_wait_ms`, stays queued up to that long (from when it entered the queue) for it.
    affinity = models.CharField(max_length=8, choices=Affinity.choices, default=Affinity.PREFER)
    affinity_wait_ms = models.PositiveIntegerField(default=0)
    policy_class = models.CharField(max_length=300, blank=True, default="")
    share_window_seconds = models.FloatField(default=300.0, help_text="Window of the actual shares in /api/queue/.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "queue policy"
        constraints = [models.CheckConstraint(condition=Q(id=1), name="queuepolicy_singleton")]

    def __str__(self) -> str:
        return "Queue policy"

    def weight(self, team_slug: str) -> float:
        return float(self.team_weights.get(team_slug, self.default_weight))

    def queue_depth_limit(self, team_slug: str) -> int:
        return int(
            self.max_queue_depth.get(team_slug, self.max_queue_depth.get("default", self.DEFAULT_MAX_QUEUE_DEPTH))
        )


class TeamShare(models.Model):
    """A team's past usage for fair share, decayed lazily: stored as of `updated_at`, read as
    usage * 0.5 ** (elapsed / half-life), so no job ever has to run to age it."""

    team = models.OneToOneField(Team, on_delete=models.CASCADE, primary_key=True, related_name="share")
    usage = models.FloatField(default=0.0)
    updated_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.team_id}: {self.usage:.1f} at {self.updated_at:%H:%M:%S}"

    def decayed(self, now: datetime, half_life: float) -> float:
        elapsed = max((now - self.updated_at).total_seconds(), 0.0)
        return self.usage * 0.5 ** (elapsed / half_life) if half_life > 0 else 0.0


class QueueSample(models.Model):
    """One bucket of the dashboard's history (its charts): per team, per executor, and once for the
    whole queue (team and executor both empty). Written once per bucket by whichever worker gets
    there first (scheduler/services/history.py), pruned past its retention, so the table stays at
    buckets x (teams + executors + 1) rows at most.

    `at` is the bucket's start; `values` holds what the bucket saw: gauges read as it closed
    (queued, running, slots in use, caps) and what happened in it (jobs started and finished,
    tokens, queue waits). A JSON column, so a new measure (spend) needs no migration."""

    at = models.DateTimeField()
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    executor = models.ForeignKey(Executor, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    values = models.JSONField(default=dict)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index("at", name="queuesample_at_idx")]
        constraints = [
            # One row per bucket and subject, whichever worker writes it (the others' inserts are ignored).
            models.UniqueConstraint(
                fields=["at"], name="queuesample_global_once", condition=Q(team=None, executor=None)
            ),
            models.UniqueConstraint(
                fields=["at", "team"], name="queuesample_team_once", condition=Q(team__isnull=False)
            ),
            models.UniqueConstraint(
                fields=["at", "executor"], name="queuesample_executor_once", condition=Q(executor__isnull=False)
            ),
            models.CheckConstraint(condition=Q(team=None) | Q(executor=None), name="queuesample_one_subject"),
        ]

    def __str__(self) -> str:
        subject = (
            f"team {self.team_id}" if self.team_id else f"executor {self.executor_id}" if self.executor_id else "all"
        )
        return f"{subject} at {self.at:%Y-%m-%d %H:%M:%S}"
