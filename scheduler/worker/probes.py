"""A worker's own HTTP endpoint, on TELEMACHUS_METRICS_BIND (host:port): /metrics without a token
(for a scraper on a private network; the address is the access control), /healthz, and /readyz
with the worker's heartbeat. Workers otherwise serve nothing, so this is a few lines of asyncio
rather than a web framework; database work runs on the worker's database thread."""

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings

from scheduler.metrics import metrics_exposition
from telemachus.http.health import readiness_checks

log = logging.getLogger("telemachus.worker")

DbCall = Callable[..., Awaitable[Any]]


def heartbeat_check(*, beat_at: float, interval: float) -> str:
    """ "ok" while the worker's heartbeat loop has run within three of its intervals."""
    age = time.monotonic() - beat_at
    return "ok" if age <= 3 * interval else f"no heartbeat for {age:.0f}s"


def bind_address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


async def probe_serve(*, db: DbCall, heartbeat: Callable[[], str]) -> asyncio.base_events.Server:
    """Start serving on TELEMACHUS_METRICS_BIND; the caller closes the returned server."""

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), timeout=10)
            while (await asyncio.wait_for(reader.readline(), timeout=10)) not in (b"\r\n", b"\n", b""):
                pass
            method, path = (request.decode("latin-1").split() + ["", ""])[:2]
            path = path.split("?")[0]
            status, kind, body = 404, "application/json", json.dumps({"error": "not_found"}).encode()
            if method == "GET" and path == "/metrics":
                body, kind = await db(metrics_exposition)
                status = 200
            elif method != "GET":
                status, body = 405, json.dumps({"error": "method_not_allowed"}).encode()
            elif path == "/healthz":
                status, body = 200, json.dumps({"status": "ok"}).encode()
            elif path == "/readyz":
                checks = {**await db(readiness_checks), "heartbeat": heartbeat()}
                ready = all(value == "ok" for value in checks.values())
                status = 200 if ready else 503
                body = json.dumps({"status": "ok" if ready else "unavailable", "checks": checks}).encode()
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except Exception:  # a probe must never take the worker down
            log.warning("probe request failed", exc_info=True)
        finally:
            writer.close()

    host, port = bind_address(settings.TELEMACHUS_METRICS_BIND)
    server = await asyncio.start_server(respond, host, port)
    log.info("worker probes and metrics on http://%s:%d/ (/metrics, /healthz, /readyz)", host, port)
    return server
