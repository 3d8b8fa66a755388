"""The request and response primitives of the gateway's handlers, raw ASGI (as simllm is, because
each of these paths is one small handler whose work is waiting): `Request`, `Reply`, and the
headers Django's SecurityMiddleware would add to a response (`security_headers`:
Strict-Transport-Security on a secure request when SECURE_HSTS_SECONDS is set,
X-Content-Type-Options, Referrer-Policy, Cross-Origin-Opener-Policy). The router that hands
requests to the handlers: scheduler/gateway/router.py."""

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from django.conf import settings
from rest_framework.utils.encoders import JSONEncoder

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Request:
    def __init__(self, scope: dict[str, Any], body: bytes) -> None:
        self.scope = scope
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.body = body
        self.headers: dict[str, str] = {}
        for name, value in scope.get("headers") or ():
            key = name.decode("latin1").lower()
            text = value.decode("latin1")
            if key in self.headers:  # repeated headers fold into one, as HTTP allows
                text = f"{self.headers[key]}{'; ' if key == 'cookie' else ', '}{text}"
            self.headers[key] = text
        self.query = parse_qs((scope.get("query_string") or b"").decode("latin1"))

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None

    def cookie(self, name: str) -> str | None:
        for part in (self.headers.get("cookie") or "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == name:
                return value
        return None


def security_headers(scope: dict[str, Any]) -> dict[str, str]:
    """The headers Django's SecurityMiddleware adds to a response to this request, from the same
    settings (HSTS only on a secure request: HTTPS, or a TLS proxy's header when trusted)."""
    headers = {}
    if settings.SECURE_HSTS_SECONDS and secure(scope):
        value = f"max-age={settings.SECURE_HSTS_SECONDS}"
        if settings.SECURE_HSTS_INCLUDE_SUBDOMAINS:
            value += "; includeSubDomains"
        if settings.SECURE_HSTS_PRELOAD:
            value += "; preload"
        headers["strict-transport-security"] = value
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers["x-content-type-options"] = "nosniff"
    policy = settings.SECURE_REFERRER_POLICY
    if policy:
        headers["referrer-policy"] = ",".join(
            [v.strip() for v in policy.split(",")] if isinstance(policy, str) else policy
        )
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers["cross-origin-opener-policy"] = settings.SECURE_CROSS_ORIGIN_OPENER_POLICY
    return headers


def header_list(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin1"), v.encode("latin1")) for k, v in headers.items()]


class Reply:
    """The response side of one request, and whether its client is still there (`gone` is done
    once the client disconnected)."""

    def __init__(self, receive: Receive, send: Send, scope: Scope) -> None:
        self._security = security_headers(scope)
        self._send = send
        self.started = False
        self.finished = False
        self.gone: asyncio.Future[None] = asyncio.ensure_future(_disconnected(receive))

    async def json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(body, cls=JSONEncoder).encode()
        await self.start(
            status, {"content-type": "application/json", "content-length": str(len(payload)), **(headers or {})}
        )
        await self.end(payload)

    async def start(self, status: int, headers: dict[str, str]) -> None:
        self.started = True
        await self._send(
            {"type": "http.response.start", "status": status, "headers": header_list({**headers, **self._security})}
        )

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    def close(self) -> None:
        self.gone.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def api_error(status: int, code: str, message: str) -> dict[str, Any]:
    """The REST API's error shape (telemachus/errors.py)."""
    return {"error": code, "detail": message}


def secure(scope: Scope) -> bool:
    """Whether the request came over HTTPS (or a trusted TLS proxy's header says so)."""
    if scope.get("scheme") in ("https", "wss"):
        return True
    if settings.SECURE_PROXY_SSL_HEADER:
        name, value = settings.SECURE_PROXY_SSL_HEADER
        header = name.removeprefix("HTTP_").replace("_", "-").lower().encode("latin1")
        return any(
            k.lower() == header and v.decode("latin1").split(",")[0].strip() == value
            for k, v in scope.get("headers") or ()
        )
    return False
