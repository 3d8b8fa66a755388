"""Who is calling. The same credentials as the REST API: a DRF token (`Authorization: Bearer KEY`,
as OpenAI SDKs send it, or `Authorization: Token KEY`, as the REST API documents it) and, for
the job API's paths, the session cookie of a signed-in user. Run on a database thread."""

from importlib import import_module
from types import SimpleNamespace

from django.conf import settings
from django.contrib.auth import get_user
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from telemachus.teams import rbac

KEYWORDS = ("bearer", "token")


def token_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` or `Token KEY` header, if that is what it is."""
    if not authorization:
        return None
    keyword, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if keyword.lower() not in KEYWORDS or not key or " " in key:
        return None
    return key


def user_for_token(*, key: str) -> rbac.Principal | None:
    """The active user the token belongs to, or None (unknown token, inactive user)."""
    try:
        user, _ = TokenAuthentication().authenticate_credentials(key)
    except AuthenticationFailed:
        return None
    return user


def user_for_session(*, session_key: str) -> rbac.Principal | None:
    """The signed-in user of a session cookie, checked as Django's middleware checks it (the
    session's password hash must still match), or None."""
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(SimpleNamespace(session=store))  # type: ignore[arg-type]
    return user if user.is_authenticated and user.is_active else None
