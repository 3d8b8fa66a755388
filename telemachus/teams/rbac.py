"""Who may see and do what. Every authorization decision in the project is made here (or, for
jobs and executors, in the two modules named below, built on this one), so views, services and
the dashboard agree by construction.

* Operators (superusers, or holders of `scheduler.manage`) may do everything.
* In a team, a `member` submits jobs with the permissions the team grants it and sees and cancels
  its own jobs; a `manager` also sees and cancels all the team's jobs and manages its members.
* Job types need a permission: chat and translate `chat:use`, tool `tools:invoke`, flow, task and
  a governed slot `flows:run` (a flow that names tools also needs `tools:invoke`). They are Django permissions on Team,
  granted with django-guardian on a team (to the
  team's group, so every member has it, or to single users) or globally.
* A job can also be shown to a user with guardian's `scheduler.view_job` on it; a team-owned
  executor serves other teams whose group holds `executors.use_executor` on it. Those two rules
  read the apps' own tables, so they live with them, built on this module: scheduler/rbac.py
  (jobs) and executors/selectors.py (executors).

Objects a principal may not see are reported as not found, never as forbidden, so existence does
not leak; a denial on a visible object is a 403 naming the missing permission."""

from collections.abc import Mapping
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser, User
from django.db.models import QuerySet
from guardian.core import ObjectPermissionChecker

from telemachus.errors import Forbidden, TeamNotFound, TeamRequired, ValidationFailed
from telemachus.models import Membership, Team

MANAGE_PERMISSION = "scheduler.manage"
CHAT, TOOLS, FLOWS = "chat:use", "tools:invoke", "flows:run"
# The API's permission names and the Django permissions (on Team) behind them.
PERMISSIONS = {CHAT: "use_chat", TOOLS: "invoke_tools", FLOWS: "run_flows"}

Principal = User | AnonymousUser
# An app's API key acts through a user of its own named `key:<id>` (telemachus/keys/). Usernames
# people can choose never contain a colon (Django's username validator), so none can pose as one.
KEY_PRINCIPAL_PREFIX = "key:"


def is_key_principal(user: Principal) -> bool:
    """The user an API key acts as (not a person): its membership is the key's to manage."""
    return user.is_authenticated and user.get_username().startswith(KEY_PRINCIPAL_PREFIX)


def is_operator(user: Principal) -> bool:
    return bool(user.is_authenticated and user.is_active and (user.is_superuser or user.has_perm(MANAGE_PERMISSION)))


def signed_in(user: Principal) -> User:
    """The user, once a check that refuses anonymous callers has passed (a team role or a
    permission): for the rows that record who acted."""
    if not isinstance(user, User):
        raise Forbidden("Requires a signed-in user.", permission="authenticated")
    return user


def require_operator(user: Principal) -> None:
    if not is_operator(user):
        raise Forbidden(f"Requires the {MANAGE_PERMISSION} permission.", permission=MANAGE_PERMISSION)


def require(user: Principal, permission: str, *, team: Team) -> None:
    """RBAC.require: the one check every path makes before doing something in a team. Granted
    globally or on the team (to the user or the team's group, through guardian)."""
    if is_operator(user):
        return
    codename = f"telemachus.{PERMISSIONS[permission]}"
    if user.is_authenticated and user.is_active and (user.has_perm(codename) or user.has_perm(codename, team)):
        return
    raise Forbidden(f"Requires {permission} in team {team.slug!r}.", permission=permission, team=team.slug)


def team_role(user: Principal, team: Team) -> str | None:
    """The user's role in the team, or None when not a member."""
    if not user.is_authenticated:
        return None
    return Membership.objects.filter(team=team, user=user).values_list("role", flat=True).first()


def visible_teams(user: Principal) -> QuerySet[Team]:
    if is_operator(user):
        return Team.objects.all()
    if not user.is_authenticated:
        return Team.objects.none()
    return Team.objects.filter(memberships__user=user)


def member_teams(user: Principal) -> QuerySet[Team]:
    """The teams the user is a member of (for operators too: the teams they act in by default)."""
    if not user.is_authenticated:
        return Team.objects.none()
    return Team.objects.filter(memberships__user=user).order_by("pk")


def team_for_submit(user: Principal, slug: str) -> Team:
    """The team a user may submit into. A team that exists but that the user is not in reads the
    same as one that does not exist."""
    team = visible_teams(user).filter(slug=slug).first()
    if team is None:
        raise TeamNotFound(slug)
    return team


def require_team_manager(user: Principal, team: Team) -> None:
    """Managing members: the team's managers and operators."""
    if is_operator(user) or team_role(user, team) == Membership.Role.MANAGER:
        return
    raise Forbidden(f"Requires the manager role in team {team.slug!r}.", permission="team:manage", team=team.slug)


def member_candidate(user: Principal, username: str) -> User:
    """The user that `user` (an operator or a team manager) may add to a team or give a role, by
    name. Operators may name anyone. A manager may name only people they already share a team
    with, and never an operator: otherwise a manager could pull anyone into their team, an
    operator included, and learn which usernames exist. Unknown and not-allowed read the same."""
    candidates = get_user_model().objects.filter(username=username)
    if not is_operator(user):
        candidates = candidates.filter(
            is_active=True, memberships__team__in=Membership.objects.filter(user=signed_in(user)).values("team")
        )
    candidate = candidates.first()
    if candidate is not None and is_key_principal(candidate):
        raise ValidationFailed({"username": [f"{username!r} is an API key's user: create or revoke keys instead."]})
    if candidate is None or (not is_operator(user) and is_operator(candidate)):
        reason = "" if is_operator(user) else " that you can add (managers add members of their own teams)"
        raise ValidationFailed({"username": [f"No user {username!r}{reason}."]})
    return candidate


@dataclass(frozen=True)
class Grants:
    """What one user may do in which team, read at once for the submit's hot path (kept per
    configuration version: scheduler/core/configuration.py). Decides as `is_operator`, `team_for_submit`,
    `require` and `team_role` do, from the same rows."""

    username: str
    operator: bool
    roles: dict[int, str]  # team id -> role, for the teams the user is in
    permissions: dict[int, frozenset[str]]  # team id -> API permissions held there (globally or on the team)

    def team_for_submit(self, team: Team | None, slug: str) -> Team:
        if team is None or not (self.operator or team.pk in self.roles):
            raise TeamNotFound(slug)
        return team

    def only_team(self, teams: Mapping[int, Team]) -> Team:
        """The caller's team when none is named: its only one (of `teams`, the configuration's);
        in none or in several, the caller must name it (TeamRequired)."""
        mine = [teams[pk] for pk in sorted(self.roles) if pk in teams][:2]
        if len(mine) != 1:
            raise TeamRequired(several=bool(mine))
        return mine[0]

    def require(self, permission: str, *, team: Team) -> None:
        if self.operator or permission in self.permissions.get(team.pk, ()):
            return
        raise Forbidden(f"Requires {permission} in team {team.slug!r}.", permission=permission, team=team.slug)

    def role(self, team: Team) -> str | None:
        return self.roles.get(team.pk)


def grants_load(user: User) -> Grants:
    """The user's Grants: memberships (one query), global permissions (two, Django's), and
    object permissions on the teams the user is in (two, guardian's)."""
    roles = dict(Membership.objects.filter(user=user).values_list("team_id", "role"))
    active = user.is_authenticated and user.is_active
    global_perms = user.get_all_permissions() if active else set()
    operator = bool(active and (user.is_superuser or MANAGE_PERMISSION in global_perms))
    permissions: dict[int, frozenset[str]] = {}
    if roles and active and not operator:
        teams = list(Team.objects.filter(pk__in=roles))
        checker = ObjectPermissionChecker(user)
        checker.prefetch_perms(teams)  # type: ignore[arg-type]  # a list of objects works as a queryset does
        for team in teams:
            held = set(checker.get_perms(team))
            permissions[team.pk] = frozenset(
                name
                for name, codename in PERMISSIONS.items()
                if codename in held or f"telemachus.{codename}" in global_perms
            )
    return Grants(username=user.get_username(), operator=operator, roles=roles, permissions=permissions)
