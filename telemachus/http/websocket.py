"""Who may open the dashboard's WebSocket: pages of this very site.

A browser sends the page's Origin with every WebSocket handshake, and the socket authenticates with
the session cookie, so another site's page could otherwise open it as a signed-in user (cross-site
WebSocket hijacking). channels' AllowedHostsOriginValidator compares only the Origin's host with
ALLOWED_HOSTS, so http://127.0.0.1:9999 (any other port on the host, any scheme) passed. Here the
Origin must be exactly the origin the socket was opened on (scheme, host and port), or one listed
in CSRF_TRUSTED_ORIGINS, and the host must be allowed."""

from typing import Any
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host

Scope = dict[str, Any]
DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(scheme: str, netloc: str) -> tuple[str, str, int] | None:
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port or DEFAULT_PORTS.get(scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None:
        return None
    return scheme, parts.hostname.lower(), port


def _headers(scope: Scope) -> dict[bytes, str]:
    return {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def own_origin(scope: Scope) -> tuple[str, str, int] | None:
    """The origin the socket was opened on: its Host header and scheme (https behind a TLS proxy
    that says so, when BEHIND_TLS_PROXY trusts it)."""
    headers = _headers(scope)
    secure = scope.get("scheme") in {"wss", "https"}
    if settings.SECURE_PROXY_SSL_HEADER and headers.get(b"x-forwarded-proto", "").lower() == "https":
        secure = True
    host = headers.get(b"host", "")
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return None
    return _origin("https" if secure else "http", host)


def origin_allowed(scope: Scope) -> bool:
    claimed = _headers(scope).get(b"origin")
    if not claimed:
        return False
    parts = urlsplit(claimed) if "://" in claimed else None
    origin = _origin(parts.scheme.lower(), parts.netloc) if parts else None
    if origin is None:
        return False
    trusted = {_origin(urlsplit(o).scheme.lower(), urlsplit(o).netloc) for o in settings.CSRF_TRUSTED_ORIGINS}
    return origin == own_origin(scope) or origin in trusted


class SameOriginValidator:
    """ASGI middleware for WebSocket routes: denies a handshake whose Origin is not this site."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> Any:
        if scope["type"] == "websocket" and not origin_allowed(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.app(scope, receive, send)
