"""Sign-in through OpenID Connect (the authorization code flow with PKCE), on mozilla-django-oidc:
its views and backend, told the provider's endpoints by the issuer's discovery document, with the
checks it leaves to its users made here, and users and roles kept by telemachus/teams/sso.py.

Installed only when TELEMACHUS_OIDC_ISSUER is set (settings add the backend, telemachus/urls.py
the two views and the sign-in pages' button): otherwise nothing here is imported or run.

Checked on every sign-in, beyond the library's state, nonce and signature (against the provider's
JWKS): the discovery document names the configured issuer exactly; the ID token's `iss` is that
issuer, its `aud` holds our client id, it has not expired (30 s leeway) and names a subject; the
userinfo answer, when there is one, is about the same subject. A token from another issuer, for
another client or signed by another key is refused: the sign-in fails, and nobody is created or
changed. Users are found by issuer and subject only (telemachus/teams/sso.py)."""

import logging
import threading
import time
from typing import Any

import httpx
import jwt
import requests
from django.conf import settings
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.exceptions import SuspiciousOperation
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse_lazy
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from telemachus.teams.sso import sso_user_create, sso_user_find, sso_user_sync

log = logging.getLogger("telemachus.signin")
DISCOVERY_PATH = "/.well-known/openid-configuration"
# The provider's endpoints rarely move; its keys are fetched on every sign-in (the library does).
METADATA_SECONDS = 3600
LEEWAY_SECONDS = 30

_metadata: dict[str, Any] = {}
_metadata_at = 0.0
_metadata_lock = threading.Lock()


class ProviderUnavailable(Exception):
    """The discovery document could not be had, or names another issuer."""


def provider_metadata() -> dict[str, Any]:
    """The issuer's discovery document, fetched at the first sign-in and kept an hour. Raises
    ProviderUnavailable when it cannot be fetched or its `issuer` is not the configured one."""
    global _metadata, _metadata_at
    with _metadata_lock:
        if _metadata and time.monotonic() - _metadata_at < METADATA_SECONDS:
            return _metadata
        issuer = settings.TELEMACHUS_OIDC_ISSUER
        try:
            answer = httpx.get(issuer.rstrip("/") + DISCOVERY_PATH, timeout=settings.OIDC_TIMEOUT)
            answer.raise_for_status()
            document = answer.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ProviderUnavailable(f"discovery at {issuer}: {exc}") from None
        if not isinstance(document, dict) or document.get("issuer") != issuer:
            named = document.get("issuer") if isinstance(document, dict) else None
            raise ProviderUnavailable(f"discovery at {issuer} names another issuer: {named!r}")
        _metadata, _metadata_at = document, time.monotonic()
        return document


def provider_metadata_forget() -> None:
    """Fetch the discovery document again at the next sign-in (tests: another provider)."""
    global _metadata, _metadata_at
    with _metadata_lock:
        _metadata, _metadata_at = {}, 0.0


def _setting(attr: str, *default: Any) -> Any:
    """mozilla-django-oidc's settings, with the provider's endpoints from discovery, and the
    token endpoint's client authentication as the provider prefers it (basic unless it lists
    only client_secret_post)."""
    endpoints = {
        "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
        "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
        "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
        "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
    }
    if attr in endpoints:
        return provider_metadata().get(endpoints[attr])
    if attr == "OIDC_TOKEN_USE_BASIC_AUTH":
        methods = provider_metadata().get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
        return "client_secret_basic" in methods
    return import_from_settings(attr, *default)


class OidcBackend(OIDCAuthenticationBackend):
    """Authenticates the provider's callback (a request with `code` and `state`); any other
    `authenticate()` (a password sign-in) passes it by at once, with no network call."""

    get_settings = staticmethod(_setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not the library's: it reads the endpoints here, and Django builds every backend for every
        # sign-in, so a password sign-in would wait on (or fail with) the provider.
        self.UserModel = get_user_model()
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        self.OIDC_RP_CLIENT_SECRET = settings.OIDC_RP_CLIENT_SECRET
        self.OIDC_RP_SIGN_ALGO = settings.OIDC_RP_SIGN_ALGO
        self.OIDC_RP_IDP_SIGN_KEY = None

    @property
    def OIDC_OP_TOKEN_ENDPOINT(self) -> str:  # noqa: N802  (the library's name)
        return _setting("OIDC_OP_TOKEN_ENDPOINT")  # type: ignore[no-any-return]

    @property
    def OIDC_OP_USER_ENDPOINT(self) -> str | None:  # noqa: N802
        return _setting("OIDC_OP_USER_ENDPOINT")  # type: ignore[no-any-return]

    @property
    def OIDC_OP_JWKS_ENDPOINT(self) -> str:  # noqa: N802
        return _setting("OIDC_OP_JWKS_ENDPOINT")  # type: ignore[no-any-return]

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> User | None:  # type: ignore[override]
        try:
            return super().authenticate(request, **kwargs)  # type: ignore[no-any-return]
        except (SuspiciousOperation, ProviderUnavailable, requests.RequestException) as exc:
            log.warning("single sign-on refused: %s", exc)
            return None

    def _verify_jws(self, payload: str, key: Any) -> dict[str, Any]:
        """The ID token's signature (the library's check), and what the library leaves out: the
        issuer, the audience, the expiry and the subject."""
        algorithm = jwt.get_unverified_header(payload).get("alg")
        if algorithm != self.OIDC_RP_SIGN_ALGO:
            raise SuspiciousOperation(f"ID token signed with {algorithm!r}, not {self.OIDC_RP_SIGN_ALGO!r}")
        try:
            return jwt.decode(  # type: ignore[no-any-return]
                payload,
                key,
                algorithms=[self.OIDC_RP_SIGN_ALGO],
                audience=self.OIDC_RP_CLIENT_ID,
                issuer=settings.TELEMACHUS_OIDC_ISSUER,
                leeway=LEEWAY_SECONDS,
                options={"require": ["iss", "aud", "exp", "iat", "sub"]},
            )
        except jwt.InvalidTokenError as exc:
            raise SuspiciousOperation(f"ID token refused: {exc}") from None

    def get_userinfo(self, access_token: str, id_token: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The ID token's claims, with the userinfo endpoint's (where groups usually are) over
        them; both must be about the same subject."""
        claims = dict(payload)
        if self.OIDC_OP_USER_ENDPOINT:
            info = super().get_userinfo(access_token, id_token, payload)
            if info.get("sub") != payload.get("sub"):
                raise SuspiciousOperation("the userinfo answer is about another subject than the ID token")
            claims.update(info)
        return claims

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        return bool(claims.get("sub"))

    def filter_users_by_claims(self, claims: dict[str, Any]) -> QuerySet[User]:
        user = sso_user_find(issuer=settings.TELEMACHUS_OIDC_ISSUER, claims=claims)
        if user is None:
            return self.UserModel.objects.none()
        return self.UserModel.objects.filter(pk=user.pk)

    def create_user(self, claims: dict[str, Any]) -> User:
        return sso_user_create(issuer=settings.TELEMACHUS_OIDC_ISSUER, claims=claims)

    def update_user(self, user: User, claims: dict[str, Any]) -> User:
        return sso_user_sync(user=user, issuer=settings.TELEMACHUS_OIDC_ISSUER, claims=claims)


class OidcSignInApi(OIDCAuthenticationRequestView):
    """GET /oidc/authenticate/?next=...: off to the provider's sign-in (state, nonce, PKCE)."""

    get_settings = staticmethod(_setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not the library's: the endpoint is read when used, so a provider that is down is a
        # failed sign-in below, not a server error.
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID

    @property
    def OIDC_OP_AUTH_ENDPOINT(self) -> str:  # noqa: N802
        return _setting("OIDC_OP_AUTHORIZATION_ENDPOINT")  # type: ignore[no-any-return]

    def get(self, request: HttpRequest) -> HttpResponse:
        try:
            return super().get(request)  # type: ignore[no-any-return]
        except ProviderUnavailable as exc:
            log.warning("single sign-on unavailable: %s", exc)
            return HttpResponseRedirect(settings.LOGIN_REDIRECT_URL_FAILURE)


class OidcCallbackApi(OIDCAuthenticationCallbackView):
    """GET /oidc/callback/?code=...&state=...: the provider sends the person back here."""

    get_settings = staticmethod(_setting)


def sso_context() -> dict[str, Any]:
    """What the sign-in pages show for single sign-on: the button's words and where it goes."""
    return {"sso": {"name": settings.TELEMACHUS_OIDC_NAME, "url": reverse_lazy("oidc_authentication_init")}}


def admin_sign_in(request: HttpRequest) -> HttpResponse:
    """The admin's sign-in page, with the single sign-on button beside its password form."""
    return admin.site.login(request, extra_context=sso_context())


urlpatterns = [
    path("authenticate/", OidcSignInApi.as_view(), name="oidc_authentication_init"),
    path("callback/", OidcCallbackApi.as_view(), name="oidc_authentication_callback"),
]
