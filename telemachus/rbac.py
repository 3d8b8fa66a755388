"""Who may see and do what. Every authorization decision in the project is made here, so views,
services and (later) dashboard broadcasts agree by construction.

Operators are superusers or holders of `scheduler.manage`. Team members see and submit within their
teams. Objects a principal may not see are reported as not found, never as forbidden, so existence
does not leak."""

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db.models import QuerySet

from scheduler.models import Job
from telemachus.errors import Forbidden, ValidationFailed
from telemachus.models import Membership, Team

MANAGE_PERMISSION = "scheduler.manage"

Principal = AbstractBaseUser | AnonymousUser


def is_operator(user: Principal) -> bool:
    return bool(user.is_authenticated and user.is_active and (user.is_superuser or user.has_perm(MANAGE_PERMISSION)))


def require_operator(user: Principal) -> None:
    if not is_operator(user):
        raise Forbidden(f"Requires the {MANAGE_PERMISSION} permission.", permission=MANAGE_PERMISSION)


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


def team_for_submit(user: Principal, slug: str) -> Team:
    """The team a user may submit into. A team that exists but that the user is not in reads the
    same as one that does not exist."""
    team = visible_teams(user).filter(slug=slug).first()
    if team is None:
        raise ValidationFailed({"team": [f"No team {slug!r} that you belong to."]})
    return team


def visible_jobs(user: Principal) -> QuerySet[Job]:
    if is_operator(user):
        return Job.objects.all()
    if not user.is_authenticated:
        return Job.objects.none()
    return Job.objects.filter(team__memberships__user=user)
