from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import Q

from executors.models import Executor
from quotas.concurrency import concurrency_caps, executor_limit
from scheduler.models import Job, Slot
from telemachus.models import Team
from telemachus.rbac import executor_teams


@dataclass(frozen=True)
class Capacity:
    limit: int
    in_use: int
    queued: int


def executors_usable_by(*, team: Team | int, model: str | None = None, embeddings: bool = False) -> list[Executor]:
    """Enabled executors shared with every team, owned by this one or granted to it, optionally
    only those that offer `model` (and serve embeddings: `capabilities.embeddings`). Filtered in
    Python: executors are few, and JSON containment is not portable."""
    team_id = team.pk if isinstance(team, Team) else team
    granted = [pk for pk, teams in executor_teams().items() if team_id in teams]
    candidates = Executor.objects.filter(enabled=True).filter(Q(team__isnull=True) | Q(pk__in=granted))
    return [
        e for e in candidates
        if (model is None or model in e.offered_models) and (not embeddings or e.capabilities.get("embeddings"))
    ]


def models_usable_by(team_ids: Iterable[int], *, chat: bool = False) -> dict[int, set[str]]:
    """For each team, the models of the enabled executors it may use (as executors_usable_by),
    for any number of teams in two queries; with `chat`, only of executors that answer model
    calls (not a cpu-node's task queues)."""
    from executors.registry import kind_chats  # the registry imports the contract, which imports this

    usable: dict[int, set[str]] = {team_id: set() for team_id in team_ids}
    if not usable:
        return usable
    allowed = executor_teams()
    for executor in Executor.objects.filter(enabled=True):
        if chat and not kind_chats(executor.kind):
            continue
        for team_id, models in usable.items():
            if executor.team_id is None or team_id in allowed.get(executor.pk, ()):
                models.update(executor.offered_models)
    return usable


def executor_capacity(*, executor: Executor) -> Capacity:
    return Capacity(
        limit=executor_limit(name=executor.name, max_concurrency=executor.max_concurrency, caps=concurrency_caps()),
        in_use=Slot.objects.filter(executor=executor).count(),
        queued=Job.objects.filter(status=Job.Status.QUEUED, model__in=executor.offered_models).count(),
    )
