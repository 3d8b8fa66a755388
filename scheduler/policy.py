"""Queue policies: which job goes next and where it runs.

A policy is a class with `admit(job, state)`, `order(state)` and `place(job, candidates)`. The
claim calls it with the claim lock held and never special-cases the default: a deployment swaps
it by naming a class in the TELEMACHUS_QUEUE_POLICY setting or in the QueuePolicy record.
See docs/policy.md."""

import heapq
from collections.abc import Iterator
from enum import StrEnum
from functools import cache

from django.conf import settings
from django.utils.module_loading import import_string

from scheduler.models import Job, QueuePolicy
from scheduler.selectors import queued_heads
from scheduler.state import ClaimState, ExecutorView
from telemachus.models import Team

DEFAULT_POLICY = "scheduler.policy.DefaultQueuePolicy"


class Admission(StrEnum):
    NOW = "now"
    ENQUEUE = "enqueue"
    REJECT = "reject"


class BaseQueuePolicy:
    """The contract, with default behaviour a custom policy may keep or override."""

    def __init__(self, record: QueuePolicy) -> None:
        self.record = record

    def admit(self, job: Job, state: object) -> Admission:
        """At submit: take the job now, queue it, or reject it."""
        return Admission.ENQUEUE

    def order(self, state: ClaimState, *, limit: int) -> Iterator[Job]:
        """Yield queued jobs in the order they should be tried, lazily: the claim takes slots
        between yields (updating `state`), and stops asking once it has `limit` jobs."""
        raise NotImplementedError

    def place(self, job: Job, candidates: list[ExecutorView]) -> ExecutorView | None:
        """Choose among executors that fit the job and have a free slot (the record's rule). A retry
        goes elsewhere than the executor that just failed it, when there is anywhere else."""
        if not candidates:
            return None
        elsewhere = [v for v in candidates if v.pk != job.avoid_executor_id]
        candidates = elsewhere or candidates
        rule = self.record.placement
        if rule == QueuePolicy.Placement.PACK:
            return min(candidates, key=lambda v: (v.free, v.executor.name))
        if rule == QueuePolicy.Placement.WEIGHTED:
            return min(candidates, key=lambda v: (v.in_use / (v.executor.weight or 0.001), v.executor.name))
        return min(candidates, key=lambda v: (v.executor.health != "ok", v.load, -v.executor.weight, v.executor.name))

    # Helpers for subclasses.

    def eligible_heads(self, state: ClaimState, *, limit: int) -> dict[int, list[Job]]:
        """Each team's next jobs that could run now: teams and users at their cap or out of budget
        are excluded in the query, as are models no usable executor has room for."""
        blocked = state.blocked_teams()
        wanted = {}
        for team_id in Team.objects.exclude(pk__in=blocked).order_by().values_list("pk", flat=True):
            wanted[team_id] = (state.placeable_models(team_id), int(min(limit, state.team_free(team_id))))
        return queued_heads(wanted=wanted, exclude_users=state.blocked_users(), now=state.now)


class DefaultQueuePolicy(BaseQueuePolicy):
    """Priority first, then submission order across all teams (the merge of the teams' heads)."""

    def order(self, state: ClaimState, *, limit: int) -> Iterator[Job]:
        heads = self.eligible_heads(state, limit=limit)
        frontier = [(-jobs[0].priority, jobs[0].pk, team_id, 0) for team_id, jobs in heads.items()]
        heapq.heapify(frontier)
        while frontier:
            _, _, team_id, index = heapq.heappop(frontier)
            yield heads[team_id][index]
            if index + 1 < len(heads[team_id]):
                following = heads[team_id][index + 1]
                heapq.heappush(frontier, (-following.priority, following.pk, team_id, index + 1))


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
