"""Who is calling. The same credentials as the REST API (telemachus/keys/): an app's API key or a
person's token, as `Authorization: Bearer SECRET` (as OpenAI SDKs send it) or `Token SECRET`,
and, for the job API's paths, the session cookie of a signed-in user. Bad credentials count
against the client's address and their prefix; past a limit they get 429 with Retry-After, and a
right credential from the same address is served all the same. Run on a database thread."""

from importlib import import_module
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user

from telemachus.keys.authentication import (
    Credential,
    CredentialRefused,
    TooManyFailures,
    credential_authenticate,
    secret_from_header,
)
from telemachus.teams import rbac

__all__ = ["Credential", "CredentialRefused", "TooManyFailures", "client_address", "credential_for", "user_for_session"]


def client_address(scope: dict[str, Any]) -> str:
    """The client's address, as telemachus/teams/signin.py reads it from a Django request: the peer,
    or behind a TLS proxy (BEHIND_TLS_PROXY) the last entry of X-Forwarded-For."""
    if settings.SECURE_PROXY_SSL_HEADER:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"x-forwarded-for":
                return str(value.decode("latin1").split(",")[-1].strip())
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def credential_for(*, authorization: str | None, address: str) -> Credential | None:
    """The key or token of an Authorization header, or None (no usable header). Raises
    CredentialRefused for one that matches nothing live (saying whether it was revoked or expired),
    TooManyFailures past the failure limits (telemachus/keys/failures.py)."""
    secret = secret_from_header(authorization)
    if secret is None:
        return None
    return credential_authenticate(secret=secret, address=address)


def user_for_session(*, session_key: str) -> rbac.Principal | None:
    """The signed-in user of a session cookie, checked as Django's middleware checks it (the
    session's password hash must still match), or None."""
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(SimpleNamespace(session=store))  # type: ignore[arg-type]
    return user if user.is_authenticated and user.is_active else None
