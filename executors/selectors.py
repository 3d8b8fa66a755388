"""Which executors a team may use, and what one can take. Who may place jobs on an executor is
stated once, in `executor_serves`: every reader (the API, the submit's configuration cache, the
queue snapshot, the OpenAI-compatible model list) decides through it."""

from collections.abc import Iterable

from guardian.models import GroupObjectPermission

from executors.models import Executor, ModelRoute
from telemachus.models import Team


def executor_teams(*, executors: Iterable[Executor] | None = None) -> dict[int, set[int]]:
    """For each team-owned executor, the teams that may place jobs on it: its owner and every team
    whose group holds `executors.use_executor` on it. Two queries, or one when the caller passes
    the executors (none when none of them is team-owned)."""
    if executors is None:
        owners = list(Executor.objects.filter(team__isnull=False).values_list("pk", "team_id"))
    else:
        owners = [(e.pk, e.team_id) for e in executors if e.team_id is not None]
    if not owners:
        return {}
    granted = GroupObjectPermission.objects.filter(
        permission__codename="use_executor",
        permission__content_type__app_label="executors",
        group__team__isnull=False,
    ).values_list("object_pk", "group__team")
    teams: dict[int, set[int]] = {executor_id: {owner} for executor_id, owner in owners}
    for object_pk, team_id in granted:
        teams.setdefault(int(object_pk), set()).add(team_id)
    return teams


def executor_serves(executor: Executor, team_id: int, teams: dict[int, set[int]]) -> bool:
    """Whether the team may place jobs on the executor: a shared one (no team) serves every team, a
    team-owned one its owner and the teams granted `use_executor` on it (`teams`, as
    `executor_teams` returns)."""
    return executor.team_id is None or executor.team_id == team_id or team_id in teams.get(executor.pk, ())


def executor_offers(executor: Executor, model: str | None, *, embeddings: bool = False) -> bool:
    """Offers `model` (any, when None), and serves embeddings when asked (`capabilities.embeddings`)."""
    if model is not None and model not in executor.offered_models:
        return False
    return not embeddings or bool(executor.capabilities.get("embeddings"))


def usable_executors(
    executors: Iterable[Executor],
    *,
    team_id: int,
    teams: dict[int, set[int]],
    model: str | None = None,
    embeddings: bool = False,
    chat: bool = False,
    tasks: bool = False,
) -> list[Executor]:
    """Of `executors`, the enabled ones the team may use that offer `model` (and embeddings; with
    `chat`, that answer model calls at all; with `tasks`, that run task jobs)."""
    from executors.registry import kind_chats, kind_runs_tasks  # the registry imports the contract, which imports this

    return [
        e
        for e in executors
        if e.enabled
        and executor_serves(e, team_id, teams)
        and executor_offers(e, model, embeddings=embeddings)
        and (not chat or kind_chats(e.kind))
        and (not tasks or kind_runs_tasks(e.kind))
    ]


def executors_usable_by(*, team: Team | int, model: str | None = None, embeddings: bool = False) -> list[Executor]:
    """Enabled executors the team may use, optionally only those that offer `model` (and serve
    embeddings). Filtered in Python: executors are few, and JSON containment is not portable."""
    team_id = team.pk if isinstance(team, Team) else team
    executors = list(Executor.objects.filter(enabled=True))
    return usable_executors(
        executors, team_id=team_id, teams=executor_teams(executors=executors), model=model, embeddings=embeddings
    )


def models_usable_by(team_ids: Iterable[int], *, chat: bool = False, routes: bool = False) -> dict[int, set[str]]:
    """For each team, the models of the enabled executors it may use, for any number of teams in
    two queries; with `chat`, only of executors that answer model calls (not a cpu-node's task
    queues); with `routes`, the names of the model routes one of whose models it may use too (one
    query more)."""
    usable: dict[int, set[str]] = {team_id: set() for team_id in team_ids}
    if not usable:
        return usable
    executors = list(Executor.objects.filter(enabled=True))
    teams = executor_teams(executors=executors)
    for team_id, models in usable.items():
        for executor in usable_executors(executors, team_id=team_id, teams=teams, chat=chat):
            models.update(executor.offered_models)
    if routes:
        found = list(ModelRoute.objects.values_list("name", "models"))
        for models in usable.values():
            models.update([name for name, targets in found if models.intersection(targets)])
    return usable
