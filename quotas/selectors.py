from typing import Any

from django.contrib.auth import get_user_model
from django.utils import timezone

from quotas.budget import Budgets
from quotas.models import QuotaPolicy
from telemachus.errors import NotFound
from telemachus.keys.models import ApiKey
from telemachus.models import Membership
from telemachus.teams import rbac

Scope = QuotaPolicy.Scope


def usage_report(*, user: rbac.Principal, team: str | None = None, username: str | None = None) -> list[dict[str, Any]]:
    """Usage against every token, request and money budget the caller may see, in the current
    windows: limit, used, reserved (attempts in flight), remaining and reset time (money as
    decimal strings). Operators see every budget; others the global ones, their teams' and their
    keys', and their own (a manager: also its members').
    `team` and `username` narrow the answer; naming a team or user one cannot see is a 404."""
    operator = rbac.is_operator(user)
    teams = set(rbac.visible_teams(user).values_list("slug", flat=True))
    users: set[str] | None = None  # None: every user (an operator)
    if not operator and user.is_authenticated:
        managed = Membership.objects.filter(user=user, role=Membership.Role.MANAGER).values("team")
        users = {
            user.get_username(),
            *Membership.objects.filter(team__in=managed).values_list("user__username", flat=True),
        }
    elif not operator:
        users = set()
    if team is not None and team not in teams:
        raise NotFound(f"Team {team!r} not found.")
    if (
        username is not None
        and not (operator and get_user_model().objects.filter(username=username).exists())
        and (users is None or username not in users)
    ):
        raise NotFound(f"User {username!r} not found.")

    accounts = Budgets.load(now=timezone.now()).accounts
    key_ids = [int(a.rule.subject) for a in accounts if a.rule.scope == Scope.KEY and a.rule.subject.isdigit()]
    key_teams = {str(pk): slug for pk, slug in ApiKey.objects.filter(pk__in=key_ids).values_list("pk", "team__slug")}

    def wanted(scope: str, subject: str) -> bool:
        if scope == Scope.GLOBAL:
            return True
        if scope == Scope.KEY:  # a key's budgets: everyone who sees its team
            return key_teams.get(subject) in teams and team in (None, key_teams.get(subject)) and username is None
        if scope == Scope.TEAM:
            return subject in teams and team in (None, subject) and username is None
        if scope == Scope.USER:
            return (users is None or subject in users) and username in (None, subject) and team is None
        return operator and team is None and username is None

    return [
        {
            "policy": account.rule.pk,
            "scope": account.rule.scope,
            "subject": account.rule.subject or None,
            "dimension": account.rule.dimension,
            "window": account.rule.window,
            "limit": account.show(account.rule.limit),
            "used": account.show(account.used),
            "reserved": account.show(account.reserved),
            "remaining": account.show(max(account.remaining, 0)),
            "window_start": account.start,
            "reset_at": account.end,
        }
        for account in accounts
        if wanted(account.rule.scope, account.rule.subject)
    ]
