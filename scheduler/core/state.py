"""What a claim knows about the cluster, read once under the claim lock.

`ClaimState` holds the caps and live slot counts of all four scopes and the placeable executors.
The claim asks it whether a job fits and where it could go, and tells it each
time a slot is taken, so one transaction can place several jobs without re-reading the database
and without overshooting a cap."""

import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db.models import Sum

from executors.contract import EMBEDDINGS_API
from executors.models import Executor
from quotas.budget import Account, Budgets
from quotas.concurrency import ConcurrencyCaps, SlotCounts, executor_limit
from quotas.models import ZERO, QuotaPolicy
from scheduler.core.configuration import configuration
from scheduler.core.jobtypes import kind_serves
from scheduler.core.money import job_money_estimate
from scheduler.core.prefix import PREFIX_WORK_WINDOW
from scheduler.core.selectors import slot_counts
from scheduler.models import Job, QueuePolicy, Slot
from telemachus.control.config import config_at, config_snapshot

UNCAPPED = math.inf


@dataclass
class ExecutorView:
    """One placeable executor and its load as this claim sees it."""

    executor: Executor
    limit: int
    in_use: int
    # The breaker's cooldown is over: this executor takes one trial request at a time.
    trial: bool = False
    # Teams a team-owned executor serves (its owner and teams granted use_executor); None: all.
    teams: set[int] | None = None
    # Slots batch lines hold here, and the most they may (QueuePolicy.batch_share of `limit`).
    batch_in_use: int = 0
    batch_limit: int = 0

    @property
    def pk(self) -> int:
        return self.executor.pk

    @property
    def free(self) -> int:
        return self.limit - self.in_use

    @property
    def load(self) -> float:
        return self.in_use / self.limit if self.limit else math.inf

    def usable_by(self, team_id: int) -> bool:
        return self.teams is None or team_id in self.teams

    def matches(self, job: Job) -> bool:
        """Offers the model, is of a kind that runs the job's type (model calls on model executors,
        tasks on executors that run tasks), serves embeddings for an embeddings step, and
        satisfies the optional `class` and `memory_mb` requirements."""
        capabilities = self.executor.capabilities
        if job.model not in (capabilities.get("models") or ()):
            return False
        if not kind_serves(self.executor.kind, job.type):
            return False
        if job.requirements.get("api") == EMBEDDINGS_API and not capabilities.get("embeddings"):
            return False
        wanted_class = job.requirements.get("class")
        if wanted_class and capabilities.get("class", wanted_class) != wanted_class:
            return False
        wanted_memory = job.requirements.get("memory_mb")
        offered_memory = capabilities.get("memory_mb")
        return not (wanted_memory and offered_memory is not None and wanted_memory > offered_memory)


def batch_slots(limit: int, share: float) -> int:
    """The most of an executor's `limit` slots batch lines may hold: its batch share, rounded
    down (so a share below 1 always leaves a live call a slot), within 0..limit."""
    return max(0, min(limit, math.floor(limit * share + 1e-9)))


class ClaimState:
    def __init__(
        self,
        *,
        now: datetime,
        policy: QueuePolicy,
        caps: ConcurrencyCaps,
        counts: SlotCounts,
        executors: list[ExecutorView],
        budgets: Budgets,
    ) -> None:
        self.now = now
        self.policy = policy
        self.caps = caps
        self.budgets = budgets
        self.global_in_use = counts.total
        self.team_in_use = counts.team.copy()
        self.user_in_use = counts.user.copy()
        self.executors = executors
        # When the breakers of executors now out of placement end their cooldown, and other
        # moments the policy named when it left a job queued (a round waiting for its preferred
        # executor): the claim tells its worker to claim again at the earliest.
        self.cooldown_ends: list[datetime] = []
        self.wake_moments: list[datetime] = []
        self.team_slugs: dict[int, str] = {}
        self._running_tokens: Counter[int] | None = None
        self._recent_work: Counter[int] | None = None
        # The jobs this claim has placed (`take`), so a recount keeps them.
        self.placed: list[tuple[Job, ExecutorView]] = []

    @classmethod
    def load(cls, *, policy: QueuePolicy, now: datetime) -> "ClaimState":
        """Live slots grouped by scope (one query) and the budget ledger when there are budget
        rules (one more); executors, teams and quota rules come from the configuration of the
        version the claim lock read (no query while it is unchanged). Placeable executors are
        enabled, not down, breaker not open; one past its breaker cooldown takes one trial at a
        time. Call with the claim lock held, so slot counts can only fall and budgets only grow
        while the state is in use."""
        locked = hasattr(policy, "config_version")  # read by lock_claim
        conf = configuration(config_at(policy.config_version) if locked else config_snapshot())
        caps, owned_by = conf.caps, conf.executor_teams
        # Read with the claim lock, in its round trip (lock_claim(counts=True)), or now.
        counts = policy.slot_counts if hasattr(policy, "slot_counts") else slot_counts()
        usable = [e for e in conf.executors if e.enabled and e.health != Executor.Health.DOWN]
        cooling = {
            e.pk: e.breaker_until
            for e in usable
            if e.breaker == Executor.Breaker.OPEN and e.breaker_until and e.breaker_until > now
        }
        placeable = [e for e in usable if e.pk not in cooling]
        executors = []
        for e in placeable:
            limit = executor_limit(name=e.name, max_concurrency=e.max_concurrency, caps=caps)
            trial = e.breaker != Executor.Breaker.CLOSED
            executors.append(
                ExecutorView(
                    executor=e,
                    limit=min(limit, 1) if trial else limit,
                    in_use=counts.executor[e.pk],
                    trial=trial,
                    teams=owned_by.get(e.pk, {e.team_id}) if e.team_id else None,
                    batch_in_use=counts.batch[e.pk],
                    batch_limit=batch_slots(min(limit, 1) if trial else limit, policy.batch_share),
                )
            )
        budgets = Budgets.load(now=now, rules=list(conf.rules))
        state = cls(now=now, policy=policy, caps=caps, counts=counts, executors=executors, budgets=budgets)
        state.team_slugs.update({pk: team.slug for pk, team in conf.teams.items()})
        state.cooldown_ends = list(cooling.values())
        return state

    def wake_at(self, moment: datetime) -> None:
        """A job left queued now may be placed at `moment`: the claim's `wake_in` includes it."""
        self.wake_moments.append(moment)

    def running_tokens(self) -> Counter[int]:
        """Estimated tokens of each team's running jobs (for fair share by tokens), read on first
        use and kept current as this claim takes jobs."""
        if self._running_tokens is None:
            self._running_tokens = Counter(
                dict(Slot.objects.order_by().values_list("team_id").annotate(tokens=Sum("job__cost_estimate")))
            )
        return self._running_tokens

    def recent_work(self) -> Counter[int]:
        """Per executor, how many of the last PREFIX_WORK_WINDOW placed jobs it took, as every
        process placed them (prefix placement's load bound): read on first use (one query, newest
        jobs first down the primary key, stopping at the window) and kept current as this claim
        takes jobs."""
        if self._recent_work is None:
            recent = Job.objects.filter(executor__isnull=False).order_by("-id").values_list("executor_id", flat=True)
            self._recent_work = Counter(recent[:PREFIX_WORK_WINDOW])
        return self._recent_work

    def capacity(self) -> float:
        """Slots in the system: the placeable executors' limits, within the global cap."""
        total = sum(view.limit for view in self.executors)
        cap = self.caps.global_cap
        return total if cap is None else min(total, cap)

    def global_free(self) -> float:
        if self.budgets.global_exhausted():
            return 0
        cap = self.caps.global_cap
        return UNCAPPED if cap is None else cap - self.global_in_use

    def team_free(self, team_id: int) -> float:
        cap = self.caps.team.get(team_id)
        return UNCAPPED if cap is None else cap - self.team_in_use[team_id]

    def user_free(self, user_id: int) -> float:
        cap = self.caps.user.get(user_id)
        return UNCAPPED if cap is None else cap - self.user_in_use[user_id]

    def room_anywhere(self) -> bool:
        """Some placeable executor has a free slot (else no job can be placed, whatever the order)."""
        return any(view.free > 0 for view in self.executors)

    def executor_full(self) -> bool:
        """Some placeable executor has no free slot: work for its models may be waiting for one."""
        return any(view.free <= 0 for view in self.executors)

    def capped_teams(self) -> set[int]:
        return {team_id for team_id in self.caps.team if self.team_free(team_id) <= 0}

    def capped_users(self) -> set[int]:
        return {user_id for user_id in self.caps.user if self.user_free(user_id) <= 0}

    def blocked_teams(self) -> set[int]:
        """Teams that cannot start anything now: at their slot cap or out of budget."""
        return self.capped_teams() | self.budgets.exhausted(QuotaPolicy.Scope.TEAM)

    def blocked_users(self) -> set[int]:
        """Users (an API key: its own user) at their slot cap or out of budget."""
        return (
            self.capped_users()
            | self.budgets.exhausted(QuotaPolicy.Scope.USER)
            | self.budgets.exhausted(QuotaPolicy.Scope.KEY)
        )

    def placeable_models(self, team_id: int) -> set[str]:
        """Models that some executor usable by the team could take a job for right now."""
        models: set[str] = set()
        for view in self.executors:
            if view.free > 0 and view.usable_by(team_id):
                models.update(view.executor.capabilities.get("models") or ())
        return models

    def fits(self, job: Job) -> bool:
        """A free slot at the global, team and user scopes (the executor scope is `candidates`)."""
        return self.global_free() > 0 and self.team_free(job.team_id) > 0 and self.user_free(job.user_id) > 0

    def over_budget(self, job: Job) -> Account | None:
        """The global, team, user or key budget that cannot cover the job's estimate, if any (its
        money estimate: on the dearest executor that could take it, as the executor is not chosen yet)."""
        return self.budgets.blocking(
            team_id=job.team_id, user_id=job.user_id, tokens=job.cost_estimate, money=self.money(job)
        )

    def money(self, job: Job, view: ExecutorView | None = None) -> Decimal:
        """The job's money estimate on `view`'s executor, or on the dearest placeable one usable by
        its team; nothing to price (0) when no money budget is in force."""
        if not self.budgets.has_money:
            return ZERO
        if view is not None:
            return job_money_estimate(job, [view.executor])
        return job_money_estimate(
            job, [v.executor for v in self.executors if v.usable_by(job.team_id) and v.matches(job)]
        )

    def candidates(self, job: Job) -> list[ExecutorView]:
        """Executors that fit the job, have a free slot and whose own budget covers its estimate;
        for a batch line, only those whose batch lines hold less than their batch share."""
        batch = job.batch_id is not None
        return [
            v
            for v in self.executors
            if v.free > 0
            and (not batch or v.batch_in_use < v.batch_limit)
            and v.usable_by(job.team_id)
            and v.matches(job)
            and self.budgets.blocking(
                team_id=job.team_id,
                user_id=job.user_id,
                tokens=job.cost_estimate,
                executor_id=v.pk,
                money=self.money(job, v),
            )
            is None
        ]

    def recount(self, counts: SlotCounts) -> None:
        """Replace the slot counts read with the claim lock by `counts`, read later in the claim,
        and count again the jobs this claim has placed. Why: while the lock is held slots can be
        freed but not taken, and a job whose slot was freed after the first read (a flow's round
        ended and went back to the queue) shows up queued in the heads read after it, still
        counted on its old executor. Placing it counts it a second time, and its executor can look full
        when it is not (a round sent away from the executor that holds its prefix). Counts read
        after the heads hold no slot of any head: none can be claimed but under this lock."""
        self.global_in_use = counts.total + len(self.placed)
        for mine, read in ((self.team_in_use, counts.team), (self.user_in_use, counts.user)):
            mine.clear()
            mine.update(read)
        for view in self.executors:
            view.in_use, view.batch_in_use = counts.executor[view.pk], counts.batch[view.pk]
        for job, view in self.placed:
            self.team_in_use[job.team_id] += 1
            self.user_in_use[job.user_id] += 1
            view.in_use += 1
            if job.batch_id is not None:
                view.batch_in_use += 1

    def take(self, job: Job, view: ExecutorView) -> dict[str, Any] | None:
        """Count a slot just placed, at all four scopes, and reserve the job's estimate in every
        budget it counts against: the reservation, which the job keeps until the attempt ends
        (`Job.start`)."""
        self.placed.append((job, view))
        self.global_in_use += 1
        self.team_in_use[job.team_id] += 1
        self.user_in_use[job.user_id] += 1
        view.in_use += 1
        if job.batch_id is not None:
            view.batch_in_use += 1
        if self._running_tokens is not None:
            self._running_tokens[job.team_id] += job.cost_estimate
        if self._recent_work is not None:
            self._recent_work[view.pk] += 1
        return self.budgets.reserve(
            team_id=job.team_id,
            user_id=job.user_id,
            executor_id=view.pk,
            tokens=job.cost_estimate,
            money=self.money(job, view),
        )
