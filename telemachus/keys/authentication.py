"""Who a key or token is: one lookup shared by the REST API (DRF, `CredentialAuthentication`) and
the gateway's paths (/v1/, job waits and streams: scheduler/gateway/auth.py).

Every request looks its credential up (one indexed query on the digest, its SQL compiled once:
telemachus/db/compiled.py); no credential is cached, so a revoked key or token is refused by every
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

from telemachus.db.compiled import CompiledQuery
from telemachus.keys.digests import is_api_key, secret_digests
from telemachus.keys.failures import auth_failure_record
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
    """A bad credential, after too many from its address or with its prefix: answered 429 rather
    than 401, with the seconds until the count's window ends."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(
            f"Invalid, expired or revoked key or token, and too many failed authentications; "
            f"try again in {retry_after} s."
        )
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


class CredentialRefused(Exception):
    """A secret that authenticates no one, with why in words its holder can act on: `reason` is
    `invalid` (it matches nothing), `revoked`, `expired` or `inactive` (its user is deactivated).
    Only the holder of a real key's secret learns that it was revoked or expired."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def credential_authenticate(*, secret: str, address: str) -> Credential:
    """The live key or token the secret belongs to; CredentialRefused when there is none (unknown,
    revoked, expired, its user inactive). The secret is always looked up, so a right one
    authenticates whatever failed before it; a refused one counts against `address` and its prefix,
    and raises TooManyFailures past either limit (telemachus/keys/failures.py)."""
    try:
        return _lookup(secret)
    except CredentialRefused:
        if (wait := auth_failure_record(address=address, secret=secret)) is not None:
            raise TooManyFailures(wait) from None
        raise


# A digest is unique: at most one row matches, so no ordering is asked for. Revoked keys are found
# too, so that their holder is told.
_KEY_BY_DIGEST: CompiledQuery[ApiKey] = CompiledQuery(
    lambda digests: ApiKey.objects.select_related("principal", "team").filter(digest__in=digests)[:1]
)
_TOKEN_BY_DIGEST: CompiledQuery[PersonalToken] = CompiledQuery(
    lambda digests: PersonalToken.objects.select_related("user").filter(digest__in=digests)[:1]
)
_INVALID = "Invalid key or token."


def _lookup(secret: str) -> Credential:
    now = timezone.now()
    digests = secret_digests(secret)
    if is_api_key(secret):
        key = _KEY_BY_DIGEST.first(digests=digests)
        if key is None:
            raise CredentialRefused("invalid", _INVALID)
        if key.revoked_at is not None:
            raise CredentialRefused("revoked", f"This API key was revoked at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC.")
        if key.expires_at is not None and key.expires_at <= now:
            raise CredentialRefused("expired", f"This API key expired at {key.expires_at:%Y-%m-%d %H:%M:%S} UTC.")
        if key.principal is None or not key.principal.is_active:
            raise CredentialRefused("inactive", "This API key's user is deactivated.")
        if key.last_used_at is None or now - key.last_used_at >= LAST_USED_EVERY:
            ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        return Credential(user=key.principal, key=key)
    token = _TOKEN_BY_DIGEST.first(digests=digests)
    if token is None:
        raise CredentialRefused("invalid", _INVALID)
    if not token.user.is_active:
        raise CredentialRefused("inactive", "This token's user is deactivated.")
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_EVERY:
        PersonalToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return Credential(user=token.user, token=token)


class CredentialAuthentication(BaseAuthentication):
    """DRF authentication by API key or personal token: `Authorization: Bearer SECRET` (as OpenAI
    SDKs send it) or `Token SECRET` (as DRF clients do). `request.auth` is the ApiKey or the
    PersonalToken. Bad credentials: 401; past the failure limits: 429 with Retry-After. A right
    credential is never refused for others' failures."""

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
        except CredentialRefused as exc:
            raise AuthenticationFailed(str(exc)) from None
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
