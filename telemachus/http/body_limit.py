"""The API's request-body limit, enforced where the body arrives: in the ASGI app, before Django.

Django's ASGI handler reads a whole body (to a temporary file when large) before any view or
middleware runs, and a body sent chunked, without Content-Length, reaches DRF as if it were empty.
Under /api/ and /v1/ this reads the body first: a declared length over TELEMACHUS_MAX_BODY_BYTES
is refused at once, an undeclared one is read up to the limit and handed on with its length
declared, so the views see exactly what was sent; either way a body over the limit gets
`413 payload_too_large` in the API's JSON shape."""

import json
from typing import Any

from django.conf import settings

from telemachus.http.errors import error_payload, is_api_path

Scope = dict[str, Any]


class BodyLimit:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_api_path(scope.get("path", "")):
            return await self.app(scope, receive, send)
        limit = settings.TELEMACHUS_MAX_BODY_BYTES
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _refuse(send, scope, 400, "bad_request", "Content-Length is not a number.")
            if int(declared) > limit:
                await body_drain(receive)
                return await _too_large(send, scope, limit)
            return await self.app(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                if more:
                    await body_drain(receive, len(body))
                return await _too_large(send, scope, limit)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"transfer-encoding"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# What is read and dropped of a refused body past the limit, at the least, before the refusal is sent.
DRAIN_BYTES = 1 << 20


async def body_drain(receive: Any, read: int = 0) -> None:
    """Read and drop what is left of a refused request body (`read` bytes of it were read), until
    twice TELEMACHUS_MAX_BODY_BYTES, and at least DRAIN_BYTES past it, were read in all, before
    answering. A server that closes the connection with the body unread (uvicorn; daphne reads
    every body before the app runs) makes the client's kernel reset it, and the client (or the
    proxy in front, which answers 502) sees the reset, not the 413. So every body a proxy lets
    through gets the app's answer (deploy/nginx allows twice the limit); a bigger one still ends
    that way, but only after that much was read for it."""
    limit = settings.TELEMACHUS_MAX_BODY_BYTES
    allowance = max(2 * limit, limit + DRAIN_BYTES) - read
    while allowance >= 0:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        allowance -= len(message.get("body", b""))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


async def _too_large(send: Any, scope: Scope, limit: int) -> None:
    await _refuse(send, scope, 413, "payload_too_large", f"Request body exceeds {limit} bytes.", limit=limit)


async def _refuse(send: Any, scope: Scope, status: int, code: str, detail: str, **extra: Any) -> None:
    body = json.dumps(error_payload(scope["path"], status=status, code=code, detail=detail, **extra)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
