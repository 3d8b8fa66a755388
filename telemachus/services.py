"""Team writes. Membership is kept in two places on purpose: `Membership` holds the role, the team's
`auth.Group` holds the user so guardian group permissions reach every member. These functions are
the only writers of both, so they never disagree."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, Group
from django.db import transaction
from django.db.models import ProtectedError
from guardian.shortcuts import assign_perm, get_perms, get_users_with_perms, remove_perm

from telemachus import rbac
from telemachus.errors import Conflict, NotFound, ValidationFailed
from telemachus.models import Membership, Team


def team_create(
    *, slug: str, name: str, members: list[dict] | None = None, grants: list[str] | tuple[str, ...] = (rbac.CHAT,)
) -> Team:
    """A team and its group; by default the team grants its members chat:use, nothing more."""
    with transaction.atomic():
        if Team.objects.filter(slug=slug).exists():
            raise ValidationFailed({"slug": [f"A team {slug!r} already exists."]})
        team = Team.objects.create(group=team_group(slug=slug), slug=slug, name=name)
        team_grants_set(team=team, team_grants=list(grants))
        for member in members or []:
            team_member_set(team=team, username=member["username"], role=member.get("role", Membership.Role.MEMBER))
    return team


def team_grants(*, team: Team) -> dict:
    """What the team grants: to all its members (its group) and to single users."""
    by_user: dict[str, list[str]] = {}
    for user, perms in get_users_with_perms(team, attach_perms=True, with_group_users=False).items():
        names = sorted(name for name, codename in rbac.PERMISSIONS.items() if codename in perms)
        if names:
            by_user[user.get_username()] = names
    group_perms = set(get_perms(team.group, team))
    return {"team": sorted(name for name, codename in rbac.PERMISSIONS.items() if codename in group_perms),
            "users": by_user}


def team_grants_set(*, team: Team, team_grants: list[str], user_grants: dict[str, list[str]] | None = None) -> None:
    """Replace the team's grants (guardian object permissions on the team): `team_grants` to its
    group, `user_grants` to single users (who need not be members to hold them, but can use them
    only in teams they belong to). Unknown permission names or users are a validation error."""
    user_grants = user_grants or {}
    unknown = sorted({p for p in [*team_grants, *(p for ps in user_grants.values() for p in ps)]} - set(rbac.PERMISSIONS))
    if unknown:
        raise ValidationFailed({"grants": [f"Unknown permission(s) {', '.join(unknown)}; known: {', '.join(rbac.PERMISSIONS)}."]})
    User = get_user_model()
    users = {u.get_username(): u for u in User.objects.filter(username__in=list(user_grants))}
    missing = sorted(set(user_grants) - set(users))
    if missing:
        raise ValidationFailed({"users": [f"No user {name!r}." for name in missing]})
    with transaction.atomic():
        for name, codename in rbac.PERMISSIONS.items():
            perm = f"telemachus.{codename}"
            (assign_perm if name in team_grants else remove_perm)(perm, team.group, team)
        for user, perms in get_users_with_perms(team, attach_perms=True, with_group_users=False).items():
            for codename in perms:
                if codename in rbac.PERMISSIONS.values():
                    remove_perm(f"telemachus.{codename}", user, team)
        for name, perms in user_grants.items():
            for perm in perms:
                assign_perm(f"telemachus.{rbac.PERMISSIONS[perm]}", users[name], team)


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


def team_lock(*, team: Team) -> Team:
    """Lock the team's row for the rest of the transaction; NotFound when it is gone (deleted by a
    concurrent request since the caller read it). Team deletes and membership writes take this
    lock first, so a team deleted while its members are edited is one clear outcome, not a
    foreign-key error."""
    locked = Team.objects.select_for_update().filter(pk=team.pk).first()
    if locked is None:
        raise NotFound(f"Team {team.slug!r} not found.")
    return locked


def team_delete(*, team: Team) -> None:
    """Teams that still have jobs are kept: their history is the audit trail. Locks the team."""
    with transaction.atomic():
        team = team_lock(team=team)
        group = team.group
        try:
            team.delete()
        except ProtectedError:
            raise Conflict(f"Team {team.slug!r} has jobs; it cannot be deleted.") from None
        group.delete()


def team_member_set(*, team: Team, username: str, role: str) -> Membership:
    """Add a member or change the role of an existing one. Locks the team."""
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise ValidationFailed({"username": [f"No user {username!r}."]})
    if role not in Membership.Role.values:
        raise ValidationFailed({"role": [f"Role must be one of {', '.join(Membership.Role.values)}."]})
    with transaction.atomic():
        team = team_lock(team=team)
        membership, created = Membership.objects.get_or_create(team=team, user=user, defaults={"role": role})
        if not created and membership.role != role:
            membership.role = role
            membership.save(update_fields=["role"])
        user.groups.add(team.group_id)
    return membership


def team_member_remove(*, team: Team, user: AbstractBaseUser) -> None:
    """Remove a member (role and group). Locks the team; NotFound when it or the membership is gone."""
    with transaction.atomic():
        team = team_lock(team=team)
        deleted, _ = Membership.objects.filter(team=team, user=user).delete()
        if not deleted:
            raise NotFound(f"{user.get_username()!r} is not a member of {team.slug!r}.")
        user.groups.remove(team.group_id)
