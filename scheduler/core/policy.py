"""Queue policies: whether a job is admitted, which job goes next, and where it runs.

A policy is a class with `admit(job, state)`, `order(state)` and `place(job, candidates)`. The
claim and the submit call them and never special-case the default: a deployment swaps it by
naming a class in the TELEMACHUS_QUEUE_POLICY setting or in the QueuePolicy record.
See docs/policy.md.

The default, `FairSharePolicy`:
  order   priority first (a queued job's priority ages upward after a wait, bounded, so low
          priority is delayed but never starved); within a priority, the team with the lowest
          (running cost + next job's cost + decayed past usage) / weight goes next, first ready
          first within the team (a flow's next round is ready when its last one ended). Weight 0
          takes only capacity no team with a positive weight wants.
  admit   a per-team queue depth cap (`queue_room`): beyond it, try later (with a Retry-After
          from the team's recent drain rate).
  place   the job's preferred executor when it has a free slot (round affinity, QueuePolicy.affinity),
          else least-loaded (default), pack or weighted, among executors that fit the job.
"""

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from scheduler.core.prefix import prefix_place
from scheduler.core.selectors import queue_depths, queued_heads_sent, slot_counts_sent
from scheduler.core.state import ClaimState, ExecutorView
from scheduler.models import Job, QueuePolicy, TeamShare
from telemachus.db.compiled import CompiledQuery
from telemachus.db.pipeline import together
from telemachus.models import Team

DEFAULT_POLICY = "scheduler.core.policy.FairSharePolicy"
# Drain-rate look-back for the Retry-After of a full queue, and its bounds.
DRAIN_WINDOW = timedelta(minutes=5)
RETRY_AFTER_BOUNDS = (1, 3600)


@dataclass(frozen=True)
class Admission:
    """`admit`'s answer: now | enqueue | reject (with a reason and, for a full queue, when to retry)."""

    decision: str
    reason: str = ""
    retry_after: int | None = None

    NOW, ENQUEUE, REJECT = "now", "enqueue", "reject"


class AdmissionState:
    """What admission may ask about the queue, computed only when asked."""

    def __init__(self, *, team: Team, now: datetime) -> None:
        self.team = team
        self.now = now
        # Jobs of the team ahead of this one in the same submission, not yet written.
        self.pending = 0
        self._queued: int | None = None

    def queued(self) -> int:
        """The team's queue depth, with the submission's own jobs ahead of this one (the queue
        tally, read once per state: scheduler/core/selectors.py `queue_depths`). Read without a
        lock: the depth cap itself is the submit statement's, atomic (`queue_room`)."""
        if self._queued is None:
            self._queued = queue_depths(team_ids=[self.team.pk]).get(self.team.pk, 0)
        return self._queued + self.pending

    def drain_rate(self) -> float:
        """Jobs of the team that ended per second, over the last few minutes."""
        ended = Job.objects.filter(team=self.team, finished_at__gte=self.now - DRAIN_WINDOW).count()
        return ended / DRAIN_WINDOW.total_seconds()


class BaseQueuePolicy:
    """The contract, with behaviour a custom policy may keep or override.

    `state` is the claim's state (set by the claim before it calls `order` and `place`; None at
    submit), so `place` can see the clock and every executor, the full ones included."""

    def __init__(self, record: QueuePolicy) -> None:
        self.record = record
        self.state: ClaimState | None = None

    def queue_room(self, team: Team) -> int:
        """How many jobs the team's queue may hold (its depth cap). The submit's statement admits
        a team's jobs only while its queue holds no more than this less the jobs being submitted,
        under the team's lock (scheduler/core/statements.py): the rule is applied there, once,
        atomically. Override to change the cap."""
        return self.record.queue_depth_limit(team.slug)

    def admit(self, job: Job, state: AdmissionState) -> Admission:
        """At submit, before the job is written, any admission rule besides the depth cap (which
        is `queue_room`'s): the default has none. A custom policy may refuse (e.g. outside
        business hours), reading `state.queued()` if it needs the depth."""
        return Admission(Admission.ENQUEUE)

    def queue_full(self, state: AdmissionState, *, depth: int, limit: int) -> Admission:
        """The refusal of a job whose team's queue is at its cap (`depth` jobs queued, `limit`
        allowed): try later, with an estimate of when its queue will have drained enough."""
        rate = state.drain_rate()
        wait = (depth - limit + 1) / rate if rate > 0 else 60
        low, high = RETRY_AFTER_BOUNDS
        return Admission(
            Admission.REJECT,
            f"team {state.team.slug!r} has {limit} jobs queued, its limit",
            retry_after=int(min(max(math.ceil(wait), low), high)),
        )

    def order(self, state: ClaimState, *, limit: int) -> Iterator[Job]:
        """Yield queued jobs in the order they should be tried, lazily: the claim takes slots
        between yields (updating `state`), and stops asking once it has `limit` jobs."""
        raise NotImplementedError

    def place(self, job: Job, candidates: list[ExecutorView]) -> ExecutorView | None:
        """Choose among executors that fit the job and have a free slot. A retry goes elsewhere
        than the executor that just failed it, when there is anywhere else. Then the job's
        preferred executor (`preferred`), when it is among them; else, when the policy says to
        wait for it (`affinity_waits`), nowhere yet; else the record's rule."""
        if not candidates:
            return None
        elsewhere = [v for v in candidates if v.pk != job.avoid_executor_id]
        candidates = elsewhere or candidates
        preferred = self.preferred(job, candidates)
        if preferred is not None:
            return preferred
        if self.affinity_waits(job):
            return None
        rule = self.record.placement
        if rule == QueuePolicy.Placement.PACK:
            return min(candidates, key=lambda v: (v.free, v.executor.name))
        if rule == QueuePolicy.Placement.PREFIX:
            serving = (
                [v for v in self.state.executors if v.usable_by(job.team_id) and v.matches(job)]
                if self.state is not None
                else candidates
            )
            work = self.state.recent_work() if self.state is not None else {}
            chosen = prefix_place(job, candidates, serving, work)
            if chosen is not None:
                return chosen
        if rule == QueuePolicy.Placement.WEIGHTED:
            return min(candidates, key=lambda v: (v.in_use / (v.executor.weight or 0.001), v.executor.name))
        return min(candidates, key=lambda v: (v.executor.health != "ok", v.load, -v.executor.weight, v.executor.name))

    def preferred(self, job: Job, candidates: list[ExecutorView]) -> ExecutorView | None:
        """Round affinity: the candidate that is the job's preferred executor (the one that served
        its flow's last round, or its /v1/ session's last call: `job.affinity_executor_id`), when
        the record says `prefer`. Candidates have a free slot under every cap, so preferring one
        never breaks a cap, and the order (priority, fair share) was decided before placement."""
        if self.record.affinity != QueuePolicy.Affinity.PREFER or job.affinity_executor_id is None:
            return None
        return next((v for v in candidates if v.pk == job.affinity_executor_id), None)

    def affinity_waits(self, job: Job) -> bool:
        """Whether the job stays queued for its preferred executor, which has no free slot now:
        only with `affinity_wait_ms` above 0, while the job has been queued less than that, and
        when that executor could take it at all (placeable, serves its team and model). The claim
        is told when the wait ends (`state.wake_at`), so a worker claims again then."""
        wait = self.record.affinity_wait_ms
        state = self.state
        if (
            self.record.affinity != QueuePolicy.Affinity.PREFER
            or not wait
            or job.affinity_executor_id is None
            or state is None
        ):
            return False
        view = next((v for v in state.executors if v.pk == job.affinity_executor_id), None)
        if view is None or not view.usable_by(job.team_id) or not view.matches(job):
            return False
        until = job.queued_at + timedelta(milliseconds=wait)
        if until <= state.now:
            return False
        state.wake_at(until)
        return True

    # Helpers for subclasses.

    def effective_priority(self, job: Job, now: datetime) -> int:
        """The starvation guard: after `aging_after_seconds` in the queue a job gains a level per
        `aging_step_seconds`, at most `aging_max_boost` (never past the top priority). The wait
        counts from when the job last entered the queue (`queued_at`): a flow's round has waited
        only since its previous round ended, whatever place in line it keeps. A batch's line does
        not age: it stays behind every live call."""
        record = self.record
        if job.batch_id is not None:  # a batch line never ages past live calls (docs/batches.md)
            return job.priority
        waited = (now - job.queued_at).total_seconds() - record.aging_after_seconds
        if waited < 0 or record.aging_step_seconds <= 0:
            return job.priority
        boost = min(record.aging_max_boost, 1 + int(waited // record.aging_step_seconds))
        return min(job.priority + boost, Job.PRIORITY_MAX)

    def eligible_heads(self, state: ClaimState, *, limit: int) -> dict[int, list[Job]]:
        """Each team's next jobs that could run now, best first by effective priority: teams and
        users at their cap or out of budget are excluded in the query, as are models no usable
        executor has room for. Also looks at each team's oldest jobs, which aging may have
        lifted above newer, higher-priority ones. Reading them also brings the state's slot
        counts up to date (`ClaimState.recount`), in the same round trip."""
        with together():
            read = self.eligible_heads_sent(state, limit=limit)
        return read()

    def eligible_heads_sent(self, state: ClaimState, *, limit: int) -> Callable[[], dict[int, list[Job]]]:
        """`eligible_heads`, its statements executed now and read when the result is called:
        inside telemachus.db.pipeline.together() they go with the block's other statements. The
        slot counts are read again after the heads, and the state recounted from them before the
        heads are returned (why: `ClaimState.recount`)."""
        wanted = {
            team_id: (state.placeable_models(team_id), int(min(limit, state.team_free(team_id))))
            for team_id in self.unblocked_teams(state)
        }
        record = self.record
        aged_before = (
            state.now - timedelta(seconds=record.aging_after_seconds)
            if record.aging_max_boost > 0 and record.aging_step_seconds > 0
            else None
        )
        read = queued_heads_sent(
            wanted=wanted, exclude_users=state.blocked_users(), now=state.now, aged_before=aged_before
        )
        counts = slot_counts_sent()

        def heads() -> dict[int, list[Job]]:
            found = read()
            state.recount(counts())
            for jobs in found.values():
                jobs.sort(key=lambda job: (-self.effective_priority(job, state.now), *ready_order(job)))
            return found

        return heads

    @staticmethod
    def unblocked_teams(state: ClaimState) -> list[int]:
        """The teams whose heads `eligible_heads` looks for: all but those at their cap or out of
        budget."""
        blocked = state.blocked_teams()
        return [team_id for team_id in state.team_slugs if team_id not in blocked]


class PriorityFifoPolicy(BaseQueuePolicy):
    """Priority, then the order jobs became ready across all teams (the merge of the teams' heads)."""

    def order(self, state: ClaimState, *, limit: int) -> Iterator[Job]:
        heads = self.eligible_heads(state, limit=limit)
        cursor = dict.fromkeys(heads, 0)
        while cursor:
            team_id = min(
                cursor,
                key=lambda t: (
                    -self.effective_priority(heads[t][cursor[t]], state.now),
                    *ready_order(heads[t][cursor[t]]),
                ),
            )
            yield heads[team_id][cursor[team_id]]
            cursor[team_id] += 1
            if cursor[team_id] == len(heads[team_id]):
                del cursor[team_id]


class FairSharePolicy(BaseQueuePolicy):
    """Priority, then weighted fair share across teams with eligible work, first ready first
    within a team.

    Past usage lets a team that has had less than its share catch up, but only up to its share of
    the slots (plus one) while other teams wait: a team that has been idle and then submits a
    burst takes the freed slots until it holds its share, not all of them."""

    def order(self, state: ClaimState, *, limit: int) -> Iterator[Job]:
        # The heads and the teams' past usage need nothing from each other: one round trip.
        with together():
            read_heads = self.eligible_heads_sent(state, limit=limit)
            read_usage = team_usage_sent(
                team_ids=self.unblocked_teams(state), now=state.now, half_life=self.record.half_life_seconds
            )
        heads, usage = read_heads(), read_usage()
        tokens = self.record.cost == QueuePolicy.Cost.TOKENS
        running = state.running_tokens() if tokens else state.team_in_use
        cursor = dict.fromkeys(heads, 0)
        weights = {team_id: self.record.weight(slug) for team_id, slug in state.team_slugs.items()}
        active = {t for t in (*heads, *(t for t, n in state.team_in_use.items() if n)) if weights.get(t, 0) > 0}
        total_weight = sum(weights[t] for t in active)
        capacity = state.capacity()

        def share_cap(team_id: int) -> float:
            if not total_weight or capacity == math.inf:
                return math.inf
            return math.floor(weights[team_id] / total_weight * capacity) + 1

        def key(team_id: int) -> tuple[Any, ...]:
            job = heads[team_id][cursor[team_id]]
            weight = weights[team_id]
            return (
                weight <= 0,
                -self.effective_priority(job, state.now),
                weight > 0 and state.team_in_use[team_id] >= share_cap(team_id),
                self.share_key(
                    running=running[team_id],
                    next_cost=job.cost_estimate if tokens else 1,
                    usage=usage.get(team_id, 0.0),
                    weight=weight,
                ),
                *ready_order(job),
            )

        while cursor:
            team_id = min(cursor, key=key)
            job = heads[team_id][cursor[team_id]]
            yield job
            cursor[team_id] += 1
            if cursor[team_id] == len(heads[team_id]):
                del cursor[team_id]

    def share_key(self, *, running: float, next_cost: float, usage: float, weight: float) -> float:
        """(running cost + next job's cost + decayed usage) / weight, in one unit: slots for the
        slot-seconds cost (past usage in slot-seconds / half-life = slots held on average over the
        recent past), tokens for the tokens cost."""
        if weight <= 0:
            return math.inf
        if self.record.cost == QueuePolicy.Cost.SLOT_SECONDS:
            usage = usage / self.record.half_life_seconds if self.record.half_life_seconds > 0 else 0.0
        return (running + next_cost + usage) / weight


def ready_order(job: Job) -> tuple[datetime, int]:
    """The tie-break within a priority: when the job became ready, then its id (the queue
    indexes' order)."""
    return job.ready_at, job.pk


def team_usage(*, team_ids: list[int], now: datetime, half_life: float) -> dict[int, float]:
    """Each team's past usage, decayed to `now` (one query, in every claim: compiled once)."""
    return team_usage_sent(team_ids=team_ids, now=now, half_life=half_life)()


def team_usage_sent(*, team_ids: list[int], now: datetime, half_life: float) -> Callable[[], dict[int, float]]:
    """`team_usage`, executed now and read when the result is called (telemachus/db/pipeline.py)."""
    read = _TEAM_SHARES.sent(teams=sorted(team_ids))
    return lambda: {share.team_id: share.decayed(now, half_life) for share in read()}


_TEAM_SHARES: CompiledQuery[TeamShare] = CompiledQuery(lambda teams: TeamShare.objects.filter(team_id__in=teams))


@cache
def _policy_class(path: str) -> type[BaseQueuePolicy]:
    cls = import_string(path)
    if not (isinstance(cls, type) and issubclass(cls, BaseQueuePolicy)):
        raise TypeError(f"{path} is not a BaseQueuePolicy subclass")
    return cls


def policy_for(record: QueuePolicy) -> BaseQueuePolicy:
    """The policy in force: the setting wins, then the record's dotted path, then the default."""
    path = settings.TELEMACHUS_QUEUE_POLICY or record.policy_class or DEFAULT_POLICY
    return _policy_class(path)(record)
