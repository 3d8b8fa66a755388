"""Who a key or token is: one lookup shared by the REST API (DRF, `CredentialAuthentication`) and
the gateway's paths (/v1/, job waits and streams: scheduler/gateway/auth.py).

Every request looks its credential up (one indexed query on the digest, its SQL compiled once:
telemachus/compiled.py); no credential is cached, so a revoked key or token is refused by every
API process from the moment the revoke commits. The `last_used_at` stamp is written at most once
a minute per credential."""

from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth.models import User
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from telemachus.compiled import CompiledQuery
from telemachus.keys.digests import is_api_key, secret_digests
from telemachus.keys.failures import auth_failure_record, auth_retry_after
from telemachus.keys.models import ApiKey, PersonalToken
from telemachus.teams.signin import client_address

KEYWORDS = ("bearer", "token")
LAST_USED_EVERY = timedelta(minutes=1)


@dataclass(frozen=True)
class Credential:
    """An authenticated caller: the user it acts as, and the app key it came with (None: a
    person's token)."""

    user: User
    key: ApiKey | None = None
    token: PersonalToken | None = None


class TooManyFailures(Exception):
    """This address presented too many bad credentials; it may try again after `retry_after` s."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"Too many failed authentications from this address; try again in {retry_after} s.")
        self.retry_after = retry_after


def secret_from_header(authorization: str | None) -> str | None:
    """The secret of an `Authorization: Bearer SECRET` or `Token SECRET` header, if that is what it is."""
    if not authorization:
        return None
    keyword, _, secret = authorization.strip().partition(" ")
    secret = secret.strip()
    if keyword.lower() not in KEYWORDS or not secret or " " in secret:
        return None
    return secret


def credential_authenticate(*, secret: str, address: str) -> Credential | None:
    """The live key or token the secret belongs to, or None (unknown, revoked, expired, its user
    inactive), which counts as a failure of `address`. Raises TooManyFailures, before looking,
    while the address is over its limit (telemachus/keys/failures.py)."""
    wait = auth_retry_after(address=address)
    if wait is not None:
        raise TooManyFailures(wait)
    found = _lookup(secret)
    if found is None:
        auth_failure_record(address=address)
    return found


# A digest is unique: at most one row matches, so no ordering is asked for.
_KEY_BY_DIGEST = CompiledQuery(
    lambda digests: ApiKey.objects.select_related("principal", "team").filter(
        digest__in=digests, revoked_at__isnull=True
    )[:1]
)
_TOKEN_BY_DIGEST = CompiledQuery(
    lambda digests: PersonalToken.objects.select_related("user").filter(digest__in=digests)[:1]
)


def _lookup(secret: str) -> Credential | None:
    now = timezone.now()
    digests = secret_digests(secret)
    if is_api_key(secret):
        key = _KEY_BY_DIGEST.first(digests=digests)
        if key is None or key.principal is None or not key.principal.is_active:
            return None
        if key.expires_at is not None and key.expires_at <= now:
            return None
        if key.last_used_at is None or now - key.last_used_at >= LAST_USED_EVERY:
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        return Credential(user=key.principal, key=key)
    token = _TOKEN_BY_DIGEST.first(digests=digests)
    if token is None or not token.user.is_active:
        return None
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_EVERY:
        PersonalToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return Credential(user=token.user, token=token)


class CredentialAuthentication(BaseAuthentication):
    """DRF authentication by API key or personal token: `Authorization: Bearer SECRET` (as OpenAI
    SDKs send it) or `Token SECRET` (as DRF clients do). `request.auth` is the ApiKey or the
    PersonalToken. Bad credentials: 401; too many from one address: 429 with Retry-After."""

    def authenticate(self, request: Request) -> tuple[User, ApiKey | PersonalToken] | None:
        try:
            header = get_authorization_header(request).decode("latin1")
        except UnicodeError:  # pragma: no cover - latin1 decodes every byte
            return None
        keyword = header.strip().partition(" ")[0].lower()
        if keyword not in KEYWORDS:
            return None
        secret = secret_from_header(header)
        if secret is None:
            raise AuthenticationFailed("Invalid Authorization header: send 'Bearer <key>' or 'Token <token>'.")
        try:
            credential = credential_authenticate(secret=secret, address=client_address(request._request))
        except TooManyFailures as exc:
            raise Throttled(wait=exc.retry_after, detail=str(exc)) from None
        if credential is None:
            raise AuthenticationFailed("Invalid, expired or revoked key or token.")
        return credential.user, credential.key or credential.token  # type: ignore[return-value]

    def authenticate_header(self, request: Request) -> str:
        return "Token"


class CredentialScheme(OpenApiAuthenticationExtension):
    """The OpenAPI schema's account of CredentialAuthentication: either header form."""

    target_class = "telemachus.keys.authentication.CredentialAuthentication"
    name = ["bearerAuth", "tokenAuth"]

    def get_security_definition(self, auto_schema: object) -> list[dict[str, str]]:
        return [
            {"type": "http", "scheme": "bearer", "description": "An app's API key (tm-...) or a person's token."},
            {"type": "apiKey", "in": "header", "name": "Authorization", "description": "Token <key or token>"},
        ]

    def get_security_requirement(self, auto_schema: object) -> list[dict[str, list[str]]]:
        return [{"bearerAuth": []}, {"tokenAuth": []}]


def request_api_key(request: Request) -> ApiKey | None:
    """The app key a DRF request authenticated with, if any."""
    return request.auth if isinstance(request.auth, ApiKey) else None


class ApiKeysWhereAllowed(BasePermission):
    """A request made with an app's API key reaches only the views that serve apps (those that set
    `serves_api_keys = True`: the job API and spend); every other view answers 403. A key is an
    app's credential for running work, not a person's: it manages nothing."""

    message = "An API key may call the job API, /api/spend/ and /v1/ only; this needs a person's token."

    def has_permission(self, request: Request, view: object) -> bool:
        return request_api_key(request) is None or bool(getattr(view, "serves_api_keys", False))
