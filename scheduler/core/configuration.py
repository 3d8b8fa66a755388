"""The configuration that every claim, finish and submit reads, read once per configuration version
(telemachus/control/config.py) and shared by every call in the process until the version moves.

The claim and the finish learn the version from a statement they run anyway (the claim lock's
clock read, the finish's job lock); the submit from its team lock. So while nobody changes
configuration they read none of it, on any number of processes and hosts; the first call after a
change reads it again. Live state (slots, the ledger, fair-share usage, the queue) is never here.
Values are shared: treat them as read-only."""

from collections.abc import Iterable
from dataclasses import dataclass, field

from executors.models import Executor, ModelRoute
from executors.selectors import executor_teams, usable_executors
from quotas.budget import BUDGET_DIMENSIONS
from quotas.concurrency import ConcurrencyCaps, concurrency_caps
from quotas.models import QuotaPolicy
from quotas.rules import Rule, quota_rules
from scheduler.core.bounds import policy_in_force
from scheduler.core.selectors import stored_policy
from scheduler.models import QueuePolicy
from telemachus.control.config import ConfigSnapshot, config_snapshot
from telemachus.control.features import feature_switches
from telemachus.models import Team
from telemachus.teams import rbac

# Per-user entries (grants) kept per version, at most; beyond it they are dropped and re-read.
MAX_USERS = 10_000


@dataclass(frozen=True)
class Configuration:
    version: int
    executors: tuple[Executor, ...]
    teams: dict[int, Team]  # by id
    team_ids: dict[str, int] = field(repr=False)  # by slug
    rules: tuple[Rule, ...]
    caps: ConcurrencyCaps
    # Teams each team-owned executor serves (its owner and teams granted use_executor).
    executor_teams: dict[int, set[int]]
    # Feature switches: (feature, team id or None) -> enabled.
    features: dict[tuple[str, int | None], bool]
    # Model routes (issue #39): each public name's models, in the order they are tried.
    routes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The budget rules (tokens, requests, money) a submit checks, by whom they count
    # (`_admission_key`), each with its place in `rules`. Built once per version, so a submit looks
    # only at the rules that may count its jobs, not at every rule (a deployment with a cap or a
    # budget per user has thousands).
    _admission: dict[tuple[str, int | None], list[tuple[int, Rule]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        by_subject: dict[tuple[str, int | None], list[tuple[int, Rule]]] = {}
        for place, rule in enumerate(self.rules):
            key = _admission_key(rule)
            if key is not None:
                by_subject.setdefault(key, []).append((place, rule))
        object.__setattr__(self, "_admission", by_subject)

    def admission_rules(self, subjects: Iterable[tuple[int, int]]) -> list[Rule]:
        """The budget rules that may count jobs of these (team id, user id) pairs, in the order of
        `rules` (quotas.budget.admission_budgets picks those that do)."""
        if not self._admission:
            return []
        keys: set[tuple[str, int | None]] = {("global", None)}
        for team_id, user_id in subjects:
            keys |= {("team", team_id), ("user", user_id)}
        return [rule for _, rule in sorted(pair for key in keys for pair in self._admission.get(key, ()))]

    def team(self, slug: str) -> Team | None:
        team_id = self.team_ids.get(slug)
        return self.teams[team_id] if team_id is not None else None

    def executors_usable_by(
        self, *, team_id: int, model: str, embeddings: bool = False, chat: bool = False, tasks: bool = False
    ) -> list[Executor]:
        """As executors.selectors.executors_usable_by, from the cached configuration (with `chat`,
        only executors that answer model calls; with `tasks`, only those that run tasks)."""
        return usable_executors(
            self.executors,
            team_id=team_id,
            teams=self.executor_teams,
            model=model,
            embeddings=embeddings,
            chat=chat,
            tasks=tasks,
        )


def configuration(snapshot: ConfigSnapshot) -> Configuration:
    """The configuration as of the snapshot's version (read on first use)."""
    return snapshot.get("configuration", lambda: _load(snapshot.version))


def policy_record(snapshot: ConfigSnapshot) -> QueuePolicy:
    """The queue policy record as of the snapshot's version, as the scheduler may use it
    (scheduler/core/bounds.py: an out-of-bounds stored value is replaced, never trusted). Shared:
    read-only."""
    return snapshot.get("policy", lambda: policy_in_force(stored_policy()))


def queue_policy() -> QueuePolicy:
    """The queue policy record now: `policy_record` of the version now (one query while the
    version is unchanged). The one way the policy is read, but by its editor (`stored_policy`)."""
    return policy_record(config_snapshot())


def grants(snapshot: ConfigSnapshot, user: rbac.Principal) -> rbac.Grants:
    """What the user may do in which team, as of the snapshot's version (an anonymous caller is
    refused: only signed-in users submit)."""
    signed = rbac.signed_in(user)
    users: dict[int, rbac.Grants] = snapshot.get("grants", dict)
    found = users.get(signed.pk)
    if found is None:
        if len(users) >= MAX_USERS:
            users.clear()
        found = users.setdefault(signed.pk, rbac.grants_load(signed))
    return found


def _load(version: int) -> Configuration:
    """Executors, teams, quota rules (subjects resolved), executor grants, feature switches and
    model routes: a few plain queries."""
    executors = tuple(Executor.objects.all())
    teams = {team.pk: team for team in Team.objects.all()}
    team_ids = {team.slug: pk for pk, team in teams.items()}
    rules = tuple(
        quota_rules(
            known={
                QuotaPolicy.Scope.TEAM: team_ids,
                QuotaPolicy.Scope.EXECUTOR: {e.name: e.pk for e in executors},
            }
        )
    )
    return Configuration(
        version=version,
        executors=executors,
        teams=teams,
        team_ids=team_ids,
        rules=rules,
        caps=concurrency_caps(list(rules)),
        executor_teams=executor_teams(executors=executors),
        features=feature_switches(),
        routes={route.name: tuple(route.models) for route in ModelRoute.objects.all()},
    )


def _admission_key(rule: Rule) -> tuple[str, int | None] | None:
    """Whom a budget rule counts at submit, as quotas.rules.Rule.applies matches it: everyone, a
    team or a user (a key's rule counts its user's jobs); None for a rule that is no budget, or an
    executor's (checked at the claim, when the executor is known)."""
    if rule.dimension not in BUDGET_DIMENSIONS or rule.scope == QuotaPolicy.Scope.EXECUTOR:
        return None
    if rule.scope == QuotaPolicy.Scope.GLOBAL:
        return ("global", None)
    return ("team" if rule.scope == QuotaPolicy.Scope.TEAM else "user", rule.subject_id)
