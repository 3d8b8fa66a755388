"""Team writes. Membership is kept in two places on purpose: `Membership` holds the role, the team's
`auth.Group` holds the user so guardian group permissions reach every member. These functions are
the only writers of both, so they never disagree."""

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, User
from django.db import transaction
from django.db.models import ProtectedError
from guardian.shortcuts import assign_perm, get_perms, get_users_with_perms, remove_perm

from telemachus.control.audit import Actor, audit_record
from telemachus.db.locks import Level, rows_lock
from telemachus.errors import Conflict, NotFound, ValidationFailed, unique_or
from telemachus.models import Membership, Team
from telemachus.teams import rbac


def team_create(
    *,
    slug: str,
    name: str,
    members: list[dict] | None = None,
    grants: list[str] | tuple[str, ...] = (rbac.CHAT,),
    by: Actor = None,
) -> Team:
    """A team and its group; by default the team grants its members chat:use, nothing more.
    Audited as one `team.create` with the members and grants it starts with."""
    exists = ValidationFailed({"slug": [f"A team {slug!r} already exists."]})
    with unique_or(exists), transaction.atomic():
        if Team.objects.filter(slug=slug).exists():
            raise exists
        team = Team.objects.create(group=team_group(slug=slug), slug=slug, name=name)
        _grants_set(team=team, team_grants=list(grants))
        for member in members or []:
            _member_set(team=team, username=member["username"], role=member.get("role", Membership.Role.MEMBER))
        audit_record(
            by=by,
            action="team.create",
            object_type="team",
            object_id=team.slug,
            object_repr=team.name,
            after=team_audit_view(team),
        )
    return team


def team_audit_view(team: Team) -> dict:
    """A team as its audit events record it: name, members with roles, grants."""
    members = dict(team.memberships.order_by("user__username").values_list("user__username", "role"))
    return {"slug": team.slug, "name": team.name, "members": members, "grants": team_grants(team=team)}


def team_grants(*, team: Team) -> dict:
    """What the team grants: to all its members (its group) and to single users."""
    by_user: dict[str, list[str]] = {}
    for user, perms in get_users_with_perms(team, attach_perms=True, with_group_users=False).items():  # type: ignore[union-attr]
        names = sorted(name for name, codename in rbac.PERMISSIONS.items() if codename in perms)
        if names:
            by_user[user.get_username()] = names
    group_perms = set(get_perms(team.group, team))
    return {
        "team": sorted(name for name, codename in rbac.PERMISSIONS.items() if codename in group_perms),
        "users": by_user,
    }


def team_grants_set(
    *, team: Team, team_grants: list[str], user_grants: dict[str, list[str]] | None = None, by: Actor = None
) -> None:
    """Replace the team's grants (guardian object permissions on the team): `team_grants` to its
    group, `user_grants` to single users (who need not be members to hold them, but can use them
    only in teams they belong to). Unknown permission names or users are a validation error.
    Audited (`team.grants`) when they change."""
    with transaction.atomic():
        before = _grants_of(team)
        _grants_set(team=team, team_grants=team_grants, user_grants=user_grants)
        after = _grants_of(team)
        if after != before:
            audit_record(
                by=by,
                action="team.grants",
                object_type="team",
                object_id=team.slug,
                object_repr=team.name,
                before=before,
                after=after,
            )


def _grants_of(team: Team) -> dict:
    """team_grants, under a name the setter's `team_grants` argument does not shadow."""
    return team_grants(team=team)


def _grants_set(*, team: Team, team_grants: list[str], user_grants: dict[str, list[str]] | None = None) -> None:
    user_grants = user_grants or {}
    unknown = sorted(
        {p for p in [*team_grants, *(p for ps in user_grants.values() for p in ps)]} - set(rbac.PERMISSIONS)
    )
    if unknown:
        raise ValidationFailed(
            {"grants": [f"Unknown permission(s) {', '.join(unknown)}; known: {', '.join(rbac.PERMISSIONS)}."]}
        )
    User = get_user_model()
    users = {u.get_username(): u for u in User.objects.filter(username__in=list(user_grants))}
    missing = sorted(set(user_grants) - set(users))
    if missing:
        raise ValidationFailed({"users": [f"No user {name!r}." for name in missing]})
    with transaction.atomic():
        for name, codename in rbac.PERMISSIONS.items():
            perm = f"telemachus.{codename}"
            (assign_perm if name in team_grants else remove_perm)(perm, team.group, team)
        for user, perms in get_users_with_perms(team, attach_perms=True, with_group_users=False).items():  # type: ignore[union-attr]
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


# What an operator edits on a team itself (members and grants have their own services).
TEAM_EDITABLE = ("name", "retention_hours", "body_retention_hours")


def team_update(*, team: Team, by: Actor = None, **changes: Any) -> Team:
    """Change the team's name or retention (`TEAM_EDITABLE`: retention_hours and
    body_retention_hours, None for the deployment's; docs/retention.md). Audited as one
    `team.update` with the fields that changed, before and after; nothing written when none did.
    The workers' retention reads the new values at their next pass."""
    unknown = set(changes) - set(TEAM_EDITABLE)
    assert not unknown, f"not editable: {sorted(unknown)}"
    changed = {name: value for name, value in changes.items() if getattr(team, name) != value}
    if not changed:
        return team
    with transaction.atomic():
        before = {name: getattr(team, name) for name in changed}
        for name, value in changed.items():
            setattr(team, name, value)
        team.save(update_fields=list(changed))
        audit_record(
            by=by,
            action="team.update",
            object_type="team",
            object_id=team.slug,
            object_repr=team.name,
            before=before,
            after=changed,
        )
    return team


def team_lock(*, team: Team) -> Team:
    """Lock the team's row for the rest of the transaction; NotFound when it is gone (deleted by a
    concurrent request since the caller read it). Team deletes and membership writes take this
    lock first, so a team deleted while its members are edited is one clear outcome, not a
    foreign-key error."""
    locked = rows_lock(Team.objects.filter(pk=team.pk), level=Level.CONFIGURATION).first()
    if locked is None:
        raise NotFound(f"Team {team.slug!r} not found.")
    return locked


def team_delete(*, team: Team, by: Actor = None) -> None:
    """Teams that still have jobs are kept: their history is the audit trail. Locks the team.
    Audited (`team.delete`, with the members and grants it had)."""
    with transaction.atomic():
        team = team_lock(team=team)
        group, before = team.group, team_audit_view(team)
        try:
            with transaction.atomic():
                team.delete()
        except ProtectedError:
            raise Conflict(f"Team {team.slug!r} has jobs; it cannot be deleted.") from None
        group.delete()
        audit_record(
            by=by,
            action="team.delete",
            object_type="team",
            object_id=before["slug"],
            object_repr=before["name"],
            before=before,
        )


def team_member_set(*, team: Team, username: str, role: str, by: Actor = None) -> Membership:
    """Add a member or change the role of an existing one. Locks the team. Audited:
    `team.member_add`, or `team.member_role` with the role before and after; nothing when nothing
    changes. An API key's user is the key's to manage (telemachus/keys/services.py)."""
    if username.startswith(rbac.KEY_PRINCIPAL_PREFIX):
        raise ValidationFailed({"username": [f"{username!r} is an API key's user: create or revoke keys instead."]})
    with transaction.atomic():
        membership, was = _member_set(team=team, username=username, role=role)
        if was != role:
            audit_record(
                by=by,
                action="team.member_add" if was is None else "team.member_role",
                object_type="team",
                object_id=team.slug,
                object_repr=team.name,
                before=None if was is None else {"username": username, "role": was},
                after={"username": username, "role": role},
            )
    return membership


def _member_set(*, team: Team, username: str, role: str) -> tuple[Membership, str | None]:
    """The membership, and the role it had before (None: it is new)."""
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise ValidationFailed({"username": [f"No user {username!r}."]})
    if role not in Membership.Role.values:
        raise ValidationFailed({"role": [f"Role must be one of {', '.join(Membership.Role.values)}."]})
    with transaction.atomic():
        team = team_lock(team=team)
        membership, created = Membership.objects.get_or_create(team=team, user=user, defaults={"role": role})
        was = None if created else membership.role
        if not created and membership.role != role:
            membership.role = role
            membership.save(update_fields=["role"])
        user.groups.add(team.group_id)
    return membership, was


def team_key_principal_join(*, team: Team, user: User) -> Membership:
    """Make an API key's user a plain member of the key's team (its group too, so the team's
    grants apply). Called by api_key_create, which audits the key; locks the team."""
    membership, _ = _member_set(team=team, username=user.get_username(), role=Membership.Role.MEMBER)
    return membership


def team_member_remove(*, team: Team, user: User, by: Actor = None) -> None:
    """Remove a member (role and group). Locks the team; NotFound when it or the membership is
    gone. Audited (`team.member_remove`, with the role the member had). An API key's user leaves
    only with its team: revoke the key instead."""
    if rbac.is_key_principal(user):
        raise Conflict(f"{user.get_username()!r} is an API key's user: revoke the key instead.")
    with transaction.atomic():
        team = team_lock(team=team)
        role = Membership.objects.filter(team=team, user=user).values_list("role", flat=True).first()
        if role is None:
            raise NotFound(f"{user.get_username()!r} is not a member of {team.slug!r}.")
        Membership.objects.filter(team=team, user=user).delete()
        user.groups.remove(team.group_id)
        audit_record(
            by=by,
            action="team.member_remove",
            object_type="team",
            object_id=team.slug,
            object_repr=team.name,
            before={"username": user.get_username(), "role": role},
        )
