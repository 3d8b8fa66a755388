"""What a single sign-on makes of a person: their user (created at the first sign-in, found again by
issuer and subject), their teams' roles and their operator role, from the groups the identity
provider says they are in (telemachus/teams/oidc.py calls these with the verified claims).

The groups are the truth for what the configuration maps (TELEMACHUS_OIDC_TEAM_GROUPS,
_OPERATOR_GROUPS, _ADMIN_GROUPS): on every sign-in a missing membership is added, a role changed, a
membership whose group is gone removed; memberships of teams the mapping does not name stay as their
managers set them. Every change goes through the team and user services, so it is audited like any
other (source `sso`, actor the system: the provider's word, not a person's)."""

import re
from collections.abc import Collection
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission, User
from django.db import transaction
from django.utils import timezone

from telemachus.control.audit import audit_record, audit_source
from telemachus.models import AuditEvent, ExternalIdentity, Membership, Team
from telemachus.teams.services import team_member_remove, team_member_set

ROLE_RANK: dict[str, int] = {Membership.Role.MEMBER: 1, Membership.Role.MANAGER: 2}


def sso_groups(claims: dict[str, Any]) -> set[str]:
    """The groups claim (TELEMACHUS_OIDC_GROUPS_CLAIM) as a set of names: a list of strings, or one
    string; anything else is no group."""
    value = claims.get(settings.TELEMACHUS_OIDC_GROUPS_CLAIM)
    if isinstance(value, str):
        return {value}
    if isinstance(value, list):
        return {item for item in value if isinstance(item, str)}
    return set()


def _username_for(claims: dict[str, Any]) -> str:
    """A free username from the claims: preferred_username, else the email's local part, else the
    subject, cut to Django's characters and length, with a number added while it is taken."""
    wanted = claims.get("preferred_username") or str(claims.get("email") or "").partition("@")[0] or claims["sub"]
    base = re.sub(r"[^\w.@+-]", "-", str(wanted))[:140].strip("-") or "user"
    users = get_user_model().objects
    name, n = base, 1
    while users.filter(username__iexact=name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


def sso_user_find(*, issuer: str, claims: dict[str, Any]) -> User | None:
    """The user the issuer signs `claims["sub"]` for, if they signed in before."""
    identity = ExternalIdentity.objects.filter(issuer=issuer, subject=str(claims["sub"])).select_related("user").first()
    return identity.user if identity is not None else None


def sso_user_create(*, issuer: str, claims: dict[str, Any]) -> User:
    """A new user for a first sign-in: a free username from the claims, their email and name, no
    password (they sign in through the provider), linked to (issuer, sub); then `sso_user_sync`.
    Audited (`user.create`, source `sso`)."""
    with transaction.atomic(), audit_source(AuditEvent.Source.SSO):
        user = get_user_model().objects.create_user(
            username=_username_for(claims),
            email=str(claims.get("email") or "")[:254],
            password=None,
            first_name=str(claims.get("given_name") or "")[:150],
            last_name=str(claims.get("family_name") or "")[:150],
        )
        ExternalIdentity.objects.create(user=user, issuer=issuer, subject=str(claims["sub"]))
        audit_record(
            by=None,
            action="user.create",
            object_type="user",
            object_id=user.get_username(),
            object_repr=user.get_username(),
            after={"username": user.get_username(), "email": user.email, "issuer": issuer, "subject": claims["sub"]},
        )
        return sso_user_sync(user=user, issuer=issuer, claims=claims)


def sso_user_sync(*, user: User, issuer: str, claims: dict[str, Any]) -> User:
    """Set the user's teams' roles and operator role from the claims' groups (see the module's
    docstring), and stamp the sign-in. One transaction; each change audited."""
    groups = sso_groups(claims)
    with transaction.atomic(), audit_source(AuditEvent.Source.SSO):
        _teams_sync(user=user, groups=groups)
        _operator_sync(user=user, groups=groups)
        ExternalIdentity.objects.filter(user=user, issuer=issuer, subject=str(claims["sub"])).update(
            last_signed_in_at=timezone.now()
        )
    return user


def _teams_sync(*, user: User, groups: Collection[str]) -> None:
    mapping: dict[str, list[tuple[str, str]]] = settings.TELEMACHUS_OIDC_TEAM_GROUPS
    managed = {team for targets in mapping.values() for team, _ in targets}
    if not managed:
        return
    wanted: dict[str, str] = {}
    for group in groups:
        for team, role in mapping.get(group, ()):
            if ROLE_RANK[role] > ROLE_RANK.get(wanted.get(team, ""), 0):
                wanted[team] = role
    teams = {team.slug: team for team in Team.objects.filter(slug__in=managed)}
    current = dict(Membership.objects.filter(user=user, team__slug__in=managed).values_list("team__slug", "role"))
    for slug, role in sorted(wanted.items()):
        if slug in teams and current.get(slug) != role:
            team_member_set(team=teams[slug], username=user.get_username(), role=role)
    for slug in sorted(current.keys() - wanted.keys()):
        team_member_remove(team=teams[slug], user=user)


def _operator_sync(*, user: User, groups: Collection[str]) -> None:
    operator_groups, admin_groups = settings.TELEMACHUS_OIDC_OPERATOR_GROUPS, settings.TELEMACHUS_OIDC_ADMIN_GROUPS
    if not operator_groups and not admin_groups:
        return
    manage = Permission.objects.get(content_type__app_label="scheduler", codename="manage")
    admin = bool(set(groups) & set(admin_groups))
    operator = admin or bool(set(groups) & set(operator_groups))
    before = {
        "operator": user.user_permissions.filter(pk=manage.pk).exists(),
        "admin": user.is_superuser,
        "staff": user.is_staff,
    }
    after = {"operator": operator, "admin": admin, "staff": operator}
    if before == after:
        return
    (user.user_permissions.add if operator else user.user_permissions.remove)(manage)
    user.is_superuser, user.is_staff = admin, operator
    user.save(update_fields=["is_superuser", "is_staff"])
    audit_record(
        by=None,
        action="user.roles",
        object_type="user",
        object_id=user.get_username(),
        object_repr=user.get_username(),
        before=before,
        after=after,
    )
