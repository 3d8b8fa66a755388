"""Issuing and revoking credentials. Each returns a new secret exactly once, to its caller; what is
stored, logged and audited is its digest's row, prefix and metadata, never the secret.

Who may call these is the interface's check (managers of the key's team or operators for keys,
telemachus/keys/api.py and the admin); the services carry out and audit."""

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from telemachus.control.audit import Actor, audit_record
from telemachus.db.locks import Level, rows_lock
from telemachus.errors import ValidationFailed
from telemachus.keys.digests import KEY_MARKER, TOKEN_MARKER, secret_digest, secret_new, secret_prefix
from telemachus.keys.models import ApiKey, PersonalToken
from telemachus.models import Team
from telemachus.teams.rbac import KEY_PRINCIPAL_PREFIX
from telemachus.teams.services import team_key_principal_join

MAX_MODELS = 100
# Called with each key as it is revoked, inside the revoking transaction: the scheduler cancels
# the key's queued jobs there (scheduler/apps.py), so nothing a revoked key asked for runs later.
_revoke_hooks: list[Callable[[ApiKey, Actor], None]] = []


def api_key_revoke_hook_register(hook: Callable[[ApiKey, Actor], None]) -> None:
    if hook not in _revoke_hooks:
        _revoke_hooks.append(hook)


def api_key_audit_view(key: ApiKey) -> dict[str, Any]:
    """A key as the audit log records it: everything but its secret and digest."""
    return {
        "team": key.team.slug,
        "name": key.name,
        "prefix": key.prefix,
        "models": list(key.allowed_models),
        "expires_at": key.expires_at,
        "principal": key.principal.get_username() if key.principal else None,
    }


def api_key_create(
    *,
    team: Team,
    name: str,
    models: Sequence[str] = (),
    expires_at: datetime | None = None,
    by: Actor = None,
) -> tuple[ApiKey, str]:
    """A new key for `team`, and its secret (returned here only). The key acts through a user of
    its own (`key:<id>`, no password), added to the team as a member, so the team's grants apply
    to it and its jobs are its own. Writes the key, its user and the membership (locking the team,
    as membership writes do) and audits `api_key.create` without the secret."""
    name = name.strip()
    errors: dict[str, list[str]] = {}
    if not name:
        errors["name"] = ["A name is required (what the app is)."]
    elif ApiKey.objects.filter(team=team, name=name, revoked_at__isnull=True).exists():
        errors["name"] = [f"Team {team.slug!r} has a live key named {name!r}."]
    wanted = list(dict.fromkeys(models))
    if len(wanted) > MAX_MODELS or not all(isinstance(m, str) and 0 < len(m) <= 200 for m in wanted):
        errors["models"] = [f"At most {MAX_MODELS} model names."]
    if expires_at is not None and expires_at <= timezone.now():
        errors["expires_at"] = ["Must be in the future."]
    if errors:
        raise ValidationFailed(errors)
    secret = secret_new(KEY_MARKER)
    with transaction.atomic():
        try:
            with transaction.atomic():
                key = ApiKey.objects.create(
                    team=team,
                    name=name,
                    prefix=secret_prefix(secret),
                    digest=secret_digest(secret),
                    allowed_models=wanted,
                    created_by=by if isinstance(by, User) else None,
                    expires_at=expires_at,
                )
        except IntegrityError:  # a concurrent create took the name first
            raise ValidationFailed({"name": [f"Team {team.slug!r} has a live key named {name!r}."]}) from None
        principal = get_user_model().objects.create_user(username=f"{KEY_PRINCIPAL_PREFIX}{key.pk}", password=None)
        key.principal = principal
        key.save(update_fields=["principal"])
        team_key_principal_join(team=team, user=principal)
        audit_record(
            by=by,
            action="api_key.create",
            object_type="api_key",
            object_id=key.pk,
            object_repr=str(key),
            after=api_key_audit_view(key),
        )
    return key, secret


def api_key_revoke(*, key: ApiKey, by: Actor = None) -> ApiKey:
    """Revoke a key: from the commit on it authenticates nobody, in every API process (each request
    looks its key up; nothing caches it). Its user is deactivated too, and its queued jobs are
    canceled (the hooks); running ones finish. Locks the key's row; revoking a revoked key
    changes nothing. Audited (`api_key.revoke`)."""
    with transaction.atomic():
        # No key changes: a submit inserting a job that names the key (a key-share lock) is not held up.
        locked = (
            rows_lock(ApiKey.objects, level=Level.CONFIGURATION, of=("self",), no_key=True)
            .select_related("team", "principal")
            .get(pk=key.pk)
        )
        if locked.revoked_at is not None:
            return locked
        locked.revoked_at = timezone.now()
        locked.revoked_by = by if isinstance(by, User) else None
        locked.save(update_fields=["revoked_at", "revoked_by"])
        for hook in _revoke_hooks:
            hook(locked, by)
        if locked.principal is not None:
            locked.principal.is_active = False
            locked.principal.save(update_fields=["is_active"])
        audit_record(
            by=by,
            action="api_key.revoke",
            object_type="api_key",
            object_id=locked.pk,
            object_repr=str(locked),
            before={"revoked": False},
            after={"revoked": True},
        )
    return locked


def personal_token_issue(*, user: User, name: str = "", by: Actor = None) -> tuple[PersonalToken, str]:
    """A new personal token for `user`, and its secret (returned here only). Earlier tokens keep
    working (revoke them with `personal_tokens_revoke`). Audited (`token.create`)."""
    if user.get_username().startswith(KEY_PRINCIPAL_PREFIX):
        raise ValidationFailed({"user": ["An API key's user authenticates with its key, not a token."]})
    secret = secret_new(TOKEN_MARKER)
    with transaction.atomic():
        token = PersonalToken.objects.create(
            user=user, name=name[:100], prefix=secret_prefix(secret), digest=secret_digest(secret)
        )
        audit_record(
            by=by,
            action="token.create",
            object_type="token",
            object_id=token.pk,
            object_repr=str(token),
            after={"user": user.get_username(), "name": token.name, "prefix": token.prefix},
        )
    return token, secret


def personal_tokens_revoke(*, tokens: Sequence[PersonalToken], by: Actor = None) -> int:
    """Delete tokens (from the commit on they authenticate nobody); audited (`token.revoke`) one
    by one. Returns how many were revoked."""
    with transaction.atomic():
        for token in tokens:
            audit_record(
                by=by,
                action="token.revoke",
                object_type="token",
                object_id=token.pk,
                object_repr=str(token),
                before={"user": token.user.get_username(), "name": token.name, "prefix": token.prefix},
            )
        return PersonalToken.objects.filter(pk__in=[t.pk for t in tokens]).delete()[0]
