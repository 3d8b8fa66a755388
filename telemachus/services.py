"""Team writes. Membership is kept in two places on purpose: `Membership` holds the role, the team's
`auth.Group` holds the user so guardian group permissions reach every member. These functions are
the only writers of both, so they never disagree."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.db import transaction
from django.db.models import ProtectedError

from telemachus.errors import Conflict, ValidationFailed
from telemachus.models import Membership, Team


def team_create(*, slug: str, name: str, members: list[dict] | None = None) -> Team:
    with transaction.atomic():
        if Team.objects.filter(slug=slug).exists():
            raise ValidationFailed({"slug": [f"A team {slug!r} already exists."]})
        team = Team.objects.create(group=team_group(slug=slug), slug=slug, name=name)
        for member in members or []:
            team_member_set(team=team, username=member["username"], role=member.get("role", Membership.Role.MEMBER))
    return team


def team_group(*, slug: str) -> Group:
    """The auth.Group that carries a team's guardian permissions."""
    group, _ = Group.objects.get_or_create(name=f"team:{slug}")
    return group


def team_group_sync(*, team: Team) -> None:
    """Make the team's group hold exactly its members, after memberships were edited in bulk (admin)."""
    team.group.user_set.set(get_user_model().objects.filter(memberships__team=team))


def team_update(*, team: Team, name: str) -> Team:
    team.name = name
    team.save(update_fields=["name"])
    return team


def team_delete(*, team: Team) -> None:
    """Teams that still have jobs are kept: their history is the audit trail."""
    with transaction.atomic():
        group = team.group
        try:
            team.delete()
        except ProtectedError:
            raise Conflict(f"Team {team.slug!r} has jobs; it cannot be deleted.") from None
        group.delete()


def team_member_set(*, team: Team, username: str, role: str) -> Membership:
    """Add a member or change the role of an existing one."""
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise ValidationFailed({"username": [f"No user {username!r}."]})
    if role not in Membership.Role.values:
        raise ValidationFailed({"role": [f"Role must be one of {', '.join(Membership.Role.values)}."]})
    with transaction.atomic():
        membership, created = Membership.objects.get_or_create(team=team, user=user, defaults={"role": role})
        if not created and membership.role != role:
            membership.role = role
            membership.save(update_fields=["role"])
        user.groups.add(team.group)
    return membership


def team_member_remove(*, team: Team, user: AbstractBaseUser) -> None:
    with transaction.atomic():
        Membership.objects.filter(team=team, user=user).delete()
        user.groups.remove(team.group)
