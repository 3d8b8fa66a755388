"""Serve the ASGI app (telemachus.asgi: API, /v1/, dashboard and its WebSocket, admin) on one
address, with the server TELEMACHUS_SERVER names: `uvicorn` (the default) or `daphne`.

    python -m telemachus.serve [HOST [PORT]]       (127.0.0.1 8000)

First the settings are read and the start-up checks run (telemachus/startup.py): a configuration
error, or a set-up that cannot serve (DATABASE_URL through a pooler without TELEMACHUS_PGBOUNCER),
stops it with one line on stderr and exit status 78; otherwise it prints a banner naming the
database, the server, Redis and the metrics directory. Then this process becomes the server (its
command line run in this interpreter, the app it imports already loaded): signals reach it
directly, as they reached daphne when bin/run started it by name.

Why uvicorn by default: with uvloop and httptools it spends less CPU per request than daphne
(Twisted), which is most of what the gateway adds to a model call; measured side by side behind
LiteLLM Proxy in bench/gateway.py (bench/RESULTS.md). Both serve the same app, WebSocket included.

Uvicorn is started as daphne behaves here: no access log, no lifespan (the app has none), and no
trust in X-Forwarded-* (uvicorn's default trusts them from 127.0.0.1; the app reads them itself,
only with BEHIND_TLS_PROXY). Its HTTP protocol gives a client TELEMACHUS_HEADER_TIMEOUT_SECONDS to
send a request's headers (telemachus/http/protocol.py: uvicorn has no such bound of its own). On
SIGTERM it stops accepting, lets requests in flight finish for up to TELEMACHUS_SERVER_GRACE
seconds (default 5), then closes what is left (a stream, the dashboard's socket)."""

import os
import runpy
import sys

APP = "telemachus.asgi:application"
HEADER_TIMEOUT_PROTOCOL = "telemachus.http.protocol:HeaderTimeoutHttpToolsProtocol"


def server_argv(server: str, host: str, port: int, *, grace: int, header_timeout: float) -> list[str]:
    """The server's command line (what follows `python -m <server>`) that serves the app."""
    if server == "daphne":
        return ["-b", host, "-p", str(port), APP]
    return [
        "--host",
        host,
        "--port",
        str(port),
        "--loop",
        "uvloop",
        "--http",
        HEADER_TIMEOUT_PROTOCOL if header_timeout else "httptools",
        "--ws",
        "websockets-sansio",
        "--lifespan",
        "off",
        "--no-proxy-headers",
        "--no-access-log",
        "--timeout-graceful-shutdown",
        str(grace),
        APP,
    ]


def main(argv: list[str]) -> None:
    host = argv[0] if argv else "127.0.0.1"
    port = int(argv[1]) if len(argv) > 1 else 8000
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "telemachus.settings")

    from telemachus.environment import configuration_errors_reported

    with configuration_errors_reported("telemachus.serve"):
        import django

        django.setup()
        from django.conf import settings
        from django.db import connections

        from telemachus.startup import startup_banner

        server = settings.TELEMACHUS_SERVER
        banner = startup_banner(role=f"API on http://{host}:{port}/, served by {server}")
        connections.close_all()
        grace, header_timeout = settings.TELEMACHUS_SERVER_GRACE, settings.TELEMACHUS_HEADER_TIMEOUT_SECONDS
        command = server_argv(server, host, port, grace=grace, header_timeout=header_timeout)
    print("\n".join(banner), flush=True)
    sys.argv = [server, *command]
    runpy.run_module(server, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
