"""The router in front of Django (telemachus/asgi.py): `/v1/...` and the job API's wait and stream
paths go to the gateway's handlers (the three model APIs' dialects, the job waits), everything
else to Django.

What Django's middleware would do for these paths is done here: the Host header is checked against
ALLOWED_HOSTS, bodies are capped at TELEMACHUS_MAX_BODY_BYTES, plain HTTP is refused where
SECURE_SSL_REDIRECT asks for HTTPS, and responses carry the headers SecurityMiddleware adds
(scheduler/gateway/asgi.py, `security_headers`). No cookies are set and no state changes on a
GET, so there is nothing for CSRF protection to do."""

import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from django.http.request import split_domain_port, validate_host

from scheduler.gateway import anthropic, batches, jobwatch, openai, responses
from scheduler.gateway.asgi import (
    ASGIApp,
    Receive,
    Reply,
    Request,
    Scope,
    Send,
    api_error,
    header_list,
    secure,
    security_headers,
)
from scheduler.gateway.batches.upload import upload
from telemachus.http.body_limit import body_drain

log = logging.getLogger("telemachus.gateway")
ErrorBody = Callable[[int, str, str], dict[str, Any]]
UPLOAD = re.compile(r"^/v1/files/?$")
Handler = Callable[..., Awaitable[None]]


class GatewayRouter:
    """ASGI app: the gateway's paths here, the rest to `fallback` (Django)."""

    def __init__(self, fallback: ASGIApp) -> None:
        self.fallback = fallback
        self.routes: list[tuple[re.Pattern[str], Handler, ErrorBody]] = [
            (re.compile(r"^/v1/messages/batches(?P<rest>/.*)?$"), batches.serve_anthropic, anthropic.error_body),
            (re.compile(r"^/v1/messages(?P<rest>/.*)?$"), anthropic.serve, anthropic.error_body),
            (re.compile(r"^/v1/(?P<rest>(?:files|batches)(?:/.*)?)$"), batches.serve_openai, openai.error_body),
            (re.compile(r"^/v1/responses/*$"), responses.serve, openai.error_body),
            (re.compile(r"^/v1/(?P<rest>.*)$"), openai.serve, openai.error_body),
            (re.compile(r"^/api/jobs/(?P<job_id>[0-9]{1,18})/(?P<action>wait|stream)/$"), jobwatch.serve, api_error),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if scope["method"] == "POST" and UPLOAD.match(scope["path"]):
                return await self._upload(scope, receive, send)
            for pattern, handler, errors in self.routes:
                match = pattern.match(scope["path"])
                if match:
                    return await self._serve(handler, errors, match.groupdict(), scope, receive, send)
        return await self.fallback(scope, receive, send)

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        """POST /v1/files: its body is read by the upload as a stream (upload.py), under its own
        cap (TELEMACHUS_BATCH_FILE_MAX_BYTES)."""
        refusal = _refusal(scope)
        if refusal is not None:
            status, code, message = refusal
            return await _respond(scope, send, status, openai.error_body(status, code, message))
        try:
            await upload(scope, receive, send, error=lambda exc: exc.body())
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            await _respond(scope, send, 500, openai.error_body(500, "server_error", "The upload failed."))

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
    if settings.SECURE_SSL_REDIRECT and not secure(scope):
        return 403, "https_required", "Use HTTPS."
    return None


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
                await body_drain(receive, size)  # so the client reads the 413, not a reset
            return b"".join(chunks)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(scope: Scope, send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = {"content-type": "application/json", "content-length": str(len(payload)), **security_headers(scope)}
    await send({"type": "http.response.start", "status": status, "headers": header_list(headers)})
    await send({"type": "http.response.body", "body": payload})
