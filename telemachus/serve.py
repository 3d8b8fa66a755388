"""Serve the ASGI app (telemachus.asgi: API, /v1/, dashboard and its WebSocket, admin) on one
address, with the server TELEMACHUS_SERVER names: `uvicorn` (the default) or `daphne`.

    python -m telemachus.serve [HOST [PORT]]       (127.0.0.1 8000)

Why uvicorn by default: with uvloop and httptools it spends less CPU per request than daphne
(Twisted), which is most of what the gateway adds to a model call; measured side by side behind
LiteLLM Proxy in bench/gateway.py (bench/RESULTS.md). Both serve the same app, WebSocket included.

This process becomes the server (exec): signals reach it directly, as they reached daphne when
bin/run started it by name. Uvicorn is started as daphne behaves here: no access log, no
lifespan (the app has none), and no trust in X-Forwarded-* (uvicorn's default trusts them from
127.0.0.1; the app reads them itself, only with BEHIND_TLS_PROXY). On SIGTERM it stops
accepting, lets requests in flight finish for up to TELEMACHUS_SERVER_GRACE seconds (default
5), then closes what is left (a stream, the dashboard's socket)."""

import os
import sys

APP = "telemachus.asgi:application"
SERVERS = ("uvicorn", "daphne")


def server_argv(server: str, host: str, port: int) -> list[str]:
    """The command line (after the python executable) that serves the app with `server`."""
    if server == "daphne":
        return ["-m", "daphne", "-b", host, "-p", str(port), APP]
    if server == "uvicorn":
        grace = os.environ.get("TELEMACHUS_SERVER_GRACE", "5")
        return [
            "-m",
            "uvicorn",
            "--host",
            host,
            "--port",
            str(port),
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--ws",
            "websockets-sansio",
            "--lifespan",
            "off",
            "--no-proxy-headers",
            "--no-access-log",
            "--timeout-graceful-shutdown",
            grace,
            APP,
        ]
    raise SystemExit(f"TELEMACHUS_SERVER must be one of {', '.join(SERVERS)}, not {server!r}")


def main(argv: list[str]) -> None:
    host = argv[0] if argv else "127.0.0.1"
    port = int(argv[1]) if len(argv) > 1 else 8000
    command = server_argv(os.environ.get("TELEMACHUS_SERVER") or SERVERS[0], host, port)
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *command])


if __name__ == "__main__":
    main(sys.argv[1:])
