"""The router in front of Django (telemachus/asgi.py): `/v1/...` and the job API's wait and stream
paths are served here, everything else goes to Django. Also the request and response primitives
those handlers use; raw ASGI, as simllm is, because each of these paths is one small handler
whose work is waiting.

What Django's middleware would do for these paths is done here: the Host header is checked against
ALLOWED_HOSTS, bodies are capped at TELEMACHUS_MAX_BODY_BYTES, plain HTTP is refused where
SECURE_SSL_REDIRECT asks for HTTPS, and responses carry the headers SecurityMiddleware adds
(`security_headers`: Strict-Transport-Security on a secure request when SECURE_HSTS_SECONDS is
set, X-Content-Type-Options, Referrer-Policy, Cross-Origin-Opener-Policy). No cookies are set
and no state changes on a GET, so there is nothing for CSRF protection to do."""

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from django.conf import settings
from django.http.request import split_domain_port, validate_host
from rest_framework.utils.encoders import JSONEncoder

from telemachus.http.body_limit import body_drain

log = logging.getLogger("telemachus.gateway")
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
    if settings.SECURE_HSTS_SECONDS and _secure(scope):
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


def _header_list(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
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
            {"type": "http.response.start", "status": status, "headers": _header_list({**headers, **self._security})}
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


ErrorBody = Callable[[int, str, str], dict[str, Any]]
Handler = Callable[..., Awaitable[None]]


def api_error(status: int, code: str, message: str) -> dict[str, Any]:
    """The REST API's error shape (telemachus/errors.py)."""
    return {"error": code, "detail": message}


class GatewayRouter:
    """ASGI app: the gateway's paths here, the rest to `fallback` (Django)."""

    def __init__(self, fallback: ASGIApp) -> None:
        # the app registry is ready by the time this is built
        from scheduler.gateway import anthropic, jobs, openai

        self.fallback = fallback
        self.routes: list[tuple[re.Pattern[str], Handler, ErrorBody]] = [
            (re.compile(r"^/v1/messages(?P<rest>/.*)?$"), anthropic.serve, anthropic.error_body),
            (re.compile(r"^/v1/(?P<rest>.*)$"), openai.serve, openai.error_body),
            (re.compile(r"^/api/jobs/(?P<job_id>[0-9]{1,18})/(?P<action>wait|stream)/$"), jobs.serve, api_error),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for pattern, handler, errors in self.routes:
                match = pattern.match(scope["path"])
                if match:
                    return await self._serve(handler, errors, match.groupdict(), scope, receive, send)
        return await self.fallback(scope, receive, send)

    async def _serve(
        self,
        handler: Handler,
        errors: ErrorBody,
        kwargs: dict[str, str],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        refusal = _refusal(scope)
        if refusal is not None:
            status, code, message = refusal
            return await _respond(scope, send, status, errors(status, code, message))
        body = await _read_body(receive)
        if body is None:
            return
        if len(body) > settings.TELEMACHUS_MAX_BODY_BYTES:
            message = f"Request body is larger than {settings.TELEMACHUS_MAX_BODY_BYTES} bytes."
            return await _respond(scope, send, 413, errors(413, "payload_too_large", message))
        reply = Reply(receive, send, scope)
        try:
            await handler(Request(scope, body), reply, **kwargs)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            if not reply.started:
                await reply.json(500, errors(500, "server_error", "The server failed to answer this request."))
            elif not reply.finished:
                await reply.end()
        finally:
            reply.close()


def _refusal(scope: Scope) -> tuple[int, str, str] | None:
    """What Django's middleware would refuse: a Host not in ALLOWED_HOSTS, plain HTTP where HTTPS
    is required."""
    host = next((v.decode("latin1") for k, v in scope.get("headers") or () if k.lower() == b"host"), "")
    allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, allowed):
        return 400, "bad_request", f"Invalid Host header: {host!r}."
    if settings.SECURE_SSL_REDIRECT and not _secure(scope):
        return 403, "https_required", "Use HTTPS."
    return None


def _secure(scope: Scope) -> bool:
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


async def _read_body(receive: Receive) -> bytes | None:
    """The whole body, or as much of it as shows it is too large; None if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > settings.TELEMACHUS_MAX_BODY_BYTES:
            if message.get("more_body"):
                await body_drain(receive)  # so the client reads the 413, not a reset
            return b"".join(chunks)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(scope: Scope, send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = {"content-type": "application/json", "content-length": str(len(payload)), **security_headers(scope)}
    await send({"type": "http.response.start", "status": status, "headers": _header_list(headers)})
    await send({"type": "http.response.body", "body": payload})
