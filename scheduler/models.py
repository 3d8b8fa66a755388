import uuid
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from executors.models import Executor
from quotas.concurrency import SlotCounts
from quotas.models import ZERO, money_field
from telemachus.db.changes import TrackedChanges
from telemachus.models import ApiKey, Team


class Job(TrackedChanges, models.Model):
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
    # The model it runs on: requirements["model"], or, for a job on a model route (issue #39), the
    # route's model it stands on now (`route_models`, in order; `fall_back` moves it along),
    # copied into a column so the claim can filter and index on it.
    model = models.CharField(max_length=200)
    route = models.CharField(max_length=200, blank=True, default="", db_default="")
    route_models = models.JSONField(null=True, blank=True)
    # Past this moment (requirements.max_queue_seconds, the /v1/ header
    # X-Telemachus-Max-Queue-Seconds, from when it was submitted) a job still waiting for its first
    # start moves to its route's next model that can start it now, or ends with 429
    # queue_deadline_exceeded (scheduler/services/routes.py). Cleared when it starts.
    queue_deadline = models.DateTimeField(null=True, blank=True)
    # Chained hashes of its prompt's blocks, for prefix-cache-aware placement
    # (QueuePolicy.placement = prefix: scheduler/core/prefix.py); empty when the prompt is too short.
    prefix = models.JSONField(null=True, blank=True)
    # Its first block's hash (prefix[0]), and the executor that served the last placed job with the
    # same one when it was submitted (no reference: an id gone stale matches no executor): the
    # record of where a prefix went that every process shares, through the jobs themselves.
    prefix_key = models.CharField(max_length=16, blank=True, default="", db_default="")
    prefix_home = models.BigIntegerField(null=True, blank=True)
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
    # Whether the job waits in the queue for its budget's window to reset when the budget is spent
    # while it waits (`requirements.on_budget_exhausted`: wait, the default of /api/jobs/), or ends
    # at once with the quota error (fail: every /v1/ call, whose caller holds a connection open).
    budget_wait = models.BooleanField(default=True, db_default=True)
    # A line of a batch (scheduler/batches/): its batch and its line number there. Batch lines use
    # only capacity no live job wants (QueuePolicy.batch_share, scheduler/core/state.py).
    batch = models.ForeignKey(
        "scheduler.Batch", null=True, blank=True, on_delete=models.PROTECT, related_name="+", db_index=False
    )
    batch_line = models.PositiveIntegerField(null=True, blank=True)
    meta = models.JSONField(default=dict, blank=True)
    # A flow's durable state between rounds: rounds finished, and the messages they added after
    # input.messages (assistant replies, tool results). Written by scheduler/services/rounds.py.
    rounds = models.PositiveIntegerField(default=0)
    conversation = models.JSONField(default=list, blank=True)
    worker = models.CharField(max_length=200, blank=True, default="")
    # No index: every statement that names a lease names its jobs' ids too (the fencing pair).
    lease = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    # Body retention (scheduler/services/retention.py): when its prompt and answer were removed
    # (input's messages and arguments, conversation, result), and the earliest they may be: a
    # caller that waits for the answer (a /v1/ call, a wait) holds it until its deadline.
    body_removed_at = models.DateTimeField(null=True, blank=True)
    body_hold_until = models.DateTimeField(null=True, blank=True)

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
            # A submit under prefix placement looks up where the prefix's last placed job ran.
            models.Index("prefix_key", models.F("id").desc(), name="job_prefix_idx", condition=~Q(prefix_key="")),
            # A claim past a queue deadline (lock_claim reads the earliest) finds the jobs it ends.
            models.Index(
                "queue_deadline",
                name="job_queue_deadline_idx",
                condition=Q(status="queued", queue_deadline__isnull=False),
            ),
            # A claim that finds a route's model with no executor to take it moves its queued jobs on.
            models.Index("model", name="job_routed_idx", condition=Q(status="queued") & ~Q(route="")),
            # Retention takes each team's jobs that ended longest ago: those with their body
            # (its body removal too), and those without (docs/retention.md). A job is in one of
            # the two once it ended, so a finish adds one index entry.
            models.Index(
                "team",
                "finished_at",
                name="job_ended_idx",
                condition=Q(status__in=["done", "failed", "canceled"], body_removed_at__isnull=True),
            ),
            models.Index("team", "finished_at", name="job_stripped_idx", condition=Q(body_removed_at__isnull=False)),
            # A claim that finds a budget spent ends the queued jobs that do not wait for it.
            models.Index(
                "team", "user", name="job_no_budget_wait_idx", condition=Q(status="queued", budget_wait=False)
            ),
        ]
        constraints = [
            # A batch's line enters the queue once, whichever worker feeds it (scheduler/batches/feeder.py).
            models.UniqueConstraint(
                fields=["batch", "batch_line"], name="job_batch_line_uniq", condition=Q(batch__isnull=False)
            ),
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

    # --- transitions --------------------------------------------------------------------------
    # Each move of a job is a method here: it checks where the job stands, sets the fields the
    # move changes and records their names (TrackedChanges). None saves: callers lock the rows
    # first, batch many jobs, and write what changed with telemachus.db.changes.rows_save, which
    # derives its SQL from those names, so what is stored is what the method did.

    def start(
        self,
        *,
        executor: Executor | None,
        worker: str,
        lease: uuid.UUID,
        expires: datetime,
        now: datetime,
        reservation: dict[str, Any] | None = None,
    ) -> None:
        """queued → running: a claim placed it on `executor` (None: a tool job, which takes no
        slot) for `worker`, under `lease` until `expires`, holding `reservation` of its budgets.
        `started_at` is when it first started (a flow: its first round): a retry or a flow's next
        round is not a new start; each attempt's start is its slot's `acquired_at`."""
        assert self.status == self.Status.QUEUED, f"job {self.pk} is {self.status}, not queued"
        self.status = self.Status.RUNNING
        self.executor = executor
        self.worker = worker
        self.started_at = self.started_at or now
        self.attempts += 1
        self.lease, self.lease_expires_at = lease, expires
        self.reservation = reservation
        self.queue_deadline = None  # it waited no longer than it would: a retry has no deadline
        self.fields_changed(
            "status",
            "executor",
            "worker",
            "started_at",
            "attempts",
            "lease",
            "lease_expires_at",
            "reservation",
            "queue_deadline",
        )

    def end(
        self, *, status: str, at: datetime, result: dict[str, Any] | None = None, error: str = "", tokens: int = 0
    ) -> None:
        """running or queued → done, failed or canceled. The one place a job's end is written,
        whichever service ends it (finish, a flow's round, cancel, recovery): its status and time,
        its result or error, the tokens of the attempt that ends it added to `tokens_used`; the
        lease and the budget reservation go (the caller settles the reservation in the ledger:
        scheduler/services/attempts.py). `cost` is in the fields written: the attempt's end
        priced it (AttemptEnd.of)."""
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
        self.fields_changed(
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

    def return_to_queue(self, *, attempt_counts: bool = True) -> None:
        """running → queued, dropping the lease, placement and budget reservation: recovery took
        it from a holder that vanished, or its holder gave it back. `attempt_counts` False: the
        attempt did not fail (a worker shutting down gave it back unstarted or unfinished), so it
        is not counted against `max_attempts`. `started_at` stays when the job first started."""
        assert self.status == self.Status.RUNNING, f"job {self.pk} is {self.status}, not running"
        self.status = self.Status.QUEUED
        self.executor = None
        self.lease = None
        self.lease_expires_at = None
        self.reservation = None
        if not attempt_counts:
            self.attempts = max(self.attempts - 1, 0)
        self.fields_changed("status", "executor", "lease", "lease_expires_at", "reservation", "attempts")

    def retry(self, *, after: datetime, error: str, tokens: int) -> None:
        """running → queued after a retryable failure, to run again at `after` (its backoff),
        preferably on another executor than the one that failed it; the failure's tokens are
        counted (`cost` too: the attempt's end priced it), its error kept until it ends."""
        avoid = self.executor_id
        self.return_to_queue()
        self.error = error
        self.tokens_used = (self.tokens_used or 0) + tokens
        self.run_after = after
        self.avoid_executor_id = avoid
        self.fields_changed("error", "tokens_used", "cost", "run_after", "avoid_executor")

    def next_model(self) -> str | None:
        """The model of its route after the one it stands on (None: the last, or no route)."""
        if not self.route_models or self.model not in self.route_models:
            return None
        rest = self.route_models[self.route_models.index(self.model) + 1 :]
        return rest[0] if rest else None

    def fall_back(self, *, model: str, now: datetime, error: str = "", tokens: int = 0) -> None:
        """A job on a model route moves to a later model of it (issue #39): queued (its model's
        executors cannot take it, or its queue deadline passed) → queued on `model`, keeping its
        place in line; or running (it failed after its retries with a retryable error) → queued
        on `model` with fresh attempts, the failure's tokens counted (`cost` too: the attempt's
        end priced it) and its error kept until it ends. The executors it preferred or avoided
        served the other model, so both are forgotten."""
        assert model in (self.route_models or ()), f"{model!r} is not a model of route {self.route!r}"
        if self.status == self.Status.RUNNING:
            self.return_to_queue()
            self.attempts, self.run_after, self.error = 0, None, error
            self.tokens_used = (self.tokens_used or 0) + tokens
            self.queued_at = now
            self.fields_changed("attempts", "run_after", "error", "tokens_used", "cost", "queued_at")
        assert self.status == self.Status.QUEUED, f"job {self.pk} is {self.status}, not queued"
        self.model = model
        self.avoid_executor = self.affinity_executor = None
        self.fields_changed("model", "avoid_executor", "affinity_executor")

    def next_round(
        self,
        *,
        now: datetime,
        keep_place: bool,
        estimate: int,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """A flow's round ended with tool results added to its conversation: running → queued
        for its next round, as new work. Its wait for aging starts now; its place in line is now
        (behind what became ready while it ran), or kept (`keep_place`: QueuePolicy.flow_rounds =
        continue). It prefers the executor that served this round (whose model server may still
        hold the prefix cache of the conversation: QueuePolicy.affinity), gets fresh attempts, and
        its budgets reserve the next round's estimate (its prompt holds the whole conversation)."""
        self.affinity_executor_id = self.executor_id
        self.return_to_queue()
        self.attempts, self.error, self.run_after, self.avoid_executor = 0, "", None, None
        self.cost_estimate = estimate
        self.est_prompt_tokens, self.est_completion_tokens = prompt_tokens, completion_tokens
        self.queued_at = now
        if not keep_place:
            self.ready_at = now
        self.fields_changed(
            "affinity_executor",
            "attempts",
            "error",
            "run_after",
            "avoid_executor",
            "cost_estimate",
            "est_prompt_tokens",
            "est_completion_tokens",
            "queued_at",
            "ready_at",
        )

    def requeue_fresh(self) -> None:
        """failed or canceled → queued, as an operator sends it back once whatever failed it is
        fixed: a fresh start, its attempts, rounds, conversation, result and error cleared (a flow
        starts again from its input's messages). It keeps its place by age; its events and the
        tokens it used (billed) stay."""
        assert self.status in (self.Status.FAILED, self.Status.CANCELED), f"job {self.pk} is {self.status}"
        self.status = self.Status.QUEUED
        self.attempts = self.rounds = 0
        self.error, self.result, self.conversation = "", None, []
        self.executor = self.avoid_executor = None
        self.started_at = self.finished_at = self.run_after = self.deferred_until = None
        self.fields_changed(
            "status",
            "attempts",
            "rounds",
            "error",
            "result",
            "conversation",
            "executor",
            "avoid_executor",
            "started_at",
            "finished_at",
            "run_after",
            "deferred_until",
        )

    def cost_add(self, amount: Decimal) -> None:
        """What an attempt that ends cost (priced by scheduler/services/attempts.py)."""
        self.cost += amount
        self.fields_changed("cost")

    def reservation_released(self) -> None:
        """The running attempt's budget reservation was settled or released in the ledger."""
        if self.reservation is not None:
            self.reservation = None
            self.fields_changed("reservation")

    def round_closed(self, *, round: int, message: dict[str, Any] | None) -> None:
        """A flow's or governed slot's round `round` ended: counted, and a flow's answer (`message`)
        added to its conversation. The job's end, or its tokens, follow (`end`, `tokens_add`)."""
        self.rounds = round
        self.fields_changed("rounds")
        if self.type == self.Type.FLOW:
            self.conversation = [*self.conversation, message]
            self.fields_changed("conversation")

    def tokens_add(self, tokens: int) -> None:
        """Tokens of a round of a job that goes on running (its end adds those of its last)."""
        self.tokens_used = (self.tokens_used or 0) + tokens
        self.fields_changed("tokens_used")

    def tool_results_added(self, messages: list[dict[str, Any]]) -> None:
        """A flow's tool results (`role: tool` messages) joined its conversation."""
        self.conversation = [*self.conversation, *messages]
        self.fields_changed("conversation")

    def defer(self, *, until: datetime) -> None:
        """A queued job whose estimate its budget cannot cover waits for the window to reset at
        `until`; recorded so the deferral is reported once per window."""
        self.deferred_until = until
        self.fields_changed("deferred_until")


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
        # A job on a model route moved to its next model (issue #39), with why.
        FELL_BACK = "fell_back"
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
    # Held by a batch line: counted against the executor's batch share (QueuePolicy.batch_share).
    batch = models.BooleanField(default=False, db_default=False)

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
    next_deadline: datetime | None
    routed_queued: bool
    slot_counts: "SlotCounts"  # only when the claim asks for them with the lock

    class Placement(models.TextChoices):
        LEAST_LOADED = "least-loaded"
        PACK = "pack"
        WEIGHTED = "weighted"
        PREFIX = "prefix"

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

    # Each editable field's help_text says what it does, in the operator's words: the admin shows it
    # under the field (as HTML: no angle brackets), the dashboard's policy editor beside it (as
    # text); docs/policy.md has the whole story.
    # Weighted fair share across teams, within a priority.
    team_weights = models.JSONField(
        default=dict,
        blank=True,
        help_text='Each team\'s weight in fair share within a priority, by team slug: {"research": 3, "batch": 0}. '
        "A team not named has the default weight; 0 = spare capacity only (0 to 1,000,000).",
    )
    default_weight = models.FloatField(
        default=1.0, help_text="The weight of a team that team_weights does not name (0 to 1,000,000)."
    )
    cost = models.CharField(
        max_length=16,
        choices=Cost.choices,
        default=Cost.SLOT_SECONDS,
        help_text="What fair share counts: slot-seconds (slots held over time) or tokens (estimates for "
        "running and next jobs, actual tokens for past usage).",
    )
    half_life_seconds = models.FloatField(
        default=300.0,
        help_text="How soon fair share forgets a team's past usage: its half-life, in seconds (1 s to 30 days).",
    )
    entry_penalty = models.FloatField(
        default=1.0,
        help_text="Charged to a team's usage when one of its jobs starts (slot-seconds; tokens: the estimate) "
        "and replaced by the real cost when the attempt ends: it holds a burst back until its cost is known.",
    )
    # Starvation guard: a queued job gains one priority level per step after waiting, up to the boost.
    aging_after_seconds = models.FloatField(
        default=300.0,
        help_text="A queued job starts gaining priority after waiting this long, in seconds, so low "
        "priority is delayed but never starved.",
    )
    aging_step_seconds = models.FloatField(
        default=60.0, help_text="Once aging, a queued job gains one priority level per this many seconds."
    )
    aging_max_boost = models.PositiveSmallIntegerField(
        default=10, help_text="The most priority levels aging adds to a job (0: no aging)."
    )
    # Admission.
    max_queue_depth = models.JSONField(
        default=dict,
        blank=True,
        help_text='Each team\'s queue depth cap: {"default": 5000, "research": 20000} (no default: 10,000). '
        "A submit beyond it is refused with 429 try_later.",
    )
    priority_map = models.JSONField(
        default=dict,
        blank=True,
        help_text="Highest priority allowed by role, team or user: "
        '{"member": 0, "manager": 10, "team:research": 5, "user:alice": 8}; the most specific entry wins; '
        "operators are not limited.",
    )
    priority_over_limit = models.CharField(
        max_length=8,
        choices=OverLimit.choices,
        default=OverLimit.CLAMP,
        help_text="A priority asked above the priority map's limit: clamp (lowered to it, with a "
        "priority_clamped event) or reject (400).",
    )
    # Placement and recovery.
    placement = models.CharField(
        max_length=16,
        choices=Placement.choices,
        default=Placement.LEAST_LOADED,
        help_text="Where a job runs when several executors fit: least-loaded (lowest in use / limit), "
        "pack (fill the fullest first), weighted (in proportion to executor weight) or prefix (the executor "
        "that served the prompt's prefix recently, for its cache, within load bounds; else least-loaded).",
    )
    recovery = models.CharField(
        max_length=16,
        choices=Recovery.choices,
        default=Recovery.REQUEUE,
        help_text="A running job whose worker died (its lease expired): requeue it (while it has attempts "
        "left) or fail it.",
    )
    max_attempts = models.PositiveSmallIntegerField(
        default=3,
        help_text="Attempts a job gets: a retryable failure or a recovery requeues it until it has had "
        "this many (1 to 100).",
    )
    # A flow's next round: `requeue` queues it behind work that became ready while its last round
    # ran (other jobs run between rounds); `continue` keeps the flow's place in line, ahead of
    # newer work of its priority and team. Either way it meets caps, priority and fair share.
    flow_rounds = models.CharField(
        max_length=16,
        choices=FlowRounds.choices,
        default=FlowRounds.REQUEUE,
        help_text="A flow's next round: requeue (behind work that became ready meanwhile) or continue "
        "(keeps the flow's place in line).",
    )
    # Round affinity: `prefer` places a job on its preferred executor (Job.affinity_executor) when
    # that executor is among those with a free slot under every cap; it never changes which job
    # goes next. When it is full, the job takes another executor at once, or, with
    # `affinity_wait_ms`, stays queued up to that long (from when it entered the queue) for it.
    affinity = models.CharField(
        max_length=8,
        choices=Affinity.choices,
        default=Affinity.PREFER,
        help_text="prefer: a job runs on the executor that served its flow's last round (or its "
        "session's last call) when that one has a free slot, for its prefix cache; off: never.",
    )
    affinity_wait_ms = models.PositiveIntegerField(
        default=0,
        help_text="How long a job may stay queued for its preferred executor when that one is full, in "
        "ms from when it entered the queue (0: another executor at once; at most 60,000).",
    )
    batch_share = models.FloatField(
        default=0.75,
        help_text="The most of each executor's slots that batch lines may hold, from 0 to 1 (docs/batches.md): "
        "the rest stays free for live calls, which are always taken before batch lines.",
    )
    policy_class = models.CharField(
        max_length=300,
        blank=True,
        default="",
        help_text="Dotted path of a custom policy class (docs/policy.md); empty: the default, fair share. "
        "The TELEMACHUS_QUEUE_POLICY setting wins over it.",
    )
    share_window_seconds = models.FloatField(
        default=300.0,
        help_text="The window, in seconds, of each team's actual share of slot time in /api/queue/ and the dashboard.",
    )
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


class QueueTally(models.Model):
    """A team's queue depth as two counters kept by triggers: `in`, jobs that entered its queue,
    `out`, jobs that left it; depth = in - out, so no reader counts the queue. The table is the
    migrations' (0015 on PostgreSQL, where the counters are written at commit in one lock order
    so that claims never wait on submits; 0018 on SQLite); read through
    scheduler/core/selectors.py `queue_depths` and the submit's guard (scheduler/core/statements.py)."""

    pk = models.CompositePrimaryKey("team_id", "side")
    team_id = models.BigIntegerField()
    side = models.CharField(max_length=3)
    n = models.BigIntegerField()

    class Meta:
        managed = False
        db_table = "scheduler_queue_tally"

    def __str__(self) -> str:
        return f"team {self.team_id} {self.side} {self.n}"


class QueueSample(models.Model):
    """One bucket of the dashboard's history (its charts): per team, per executor, and once for the
    whole queue (team and executor both empty). Written once per bucket by whichever worker gets
    there first (scheduler/services/history.py), pruned past its retention, so the table stays at
    buckets x (teams + executors + 1) rows at most.

    `at` is the bucket's start; `values` holds what the bucket saw: the most each gauge was at once
    within it (queued, running, slots in use), caps as it closed, and what happened in it (jobs
    started and finished, tokens, spend, queue waits). A JSON column, so a new measure (spend)
    needs no migration."""

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


class JobTally(models.Model):
    """What retention deleted, summed: the jobs that ended per team, type and outcome, and by
    their queue wait's bucket of the metrics' histogram (`wait_bucket`: the first bound the wait
    is within, len(bounds) for +Inf, -1 for a job that never started), with their tokens and
    waits. /metrics adds these to the jobs it still has, so its totals do not fall when jobs are
    pruned (scheduler/metrics.py). Written by scheduler/services/retention.py alone, as
    increments, after the job rows it deleted (lock level 4)."""

    # The upper bounds (seconds) of /metrics' queue-wait histogram, `telemachus_job_wait_seconds`.
    WAIT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="+")
    type = models.CharField(max_length=16, choices=Job.Type.choices)
    status = models.CharField(max_length=16, choices=Job.Status.choices)
    wait_bucket = models.SmallIntegerField()
    jobs = models.BigIntegerField(default=0)
    tokens = models.BigIntegerField(default=0)
    wait_seconds = models.FloatField(default=0.0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "type", "status", "wait_bucket"], name="jobtally_unique")
        ]

    def __str__(self) -> str:
        return f"team {self.team_id} {self.type} {self.status} wait {self.wait_bucket}: {self.jobs}"


# The Batch API's models, in a module of their own (scheduler/batches/), registered with the app here.
from scheduler.batches.models import Batch, BatchLine, FileChunk, StoredFile  # noqa: E402, F401
