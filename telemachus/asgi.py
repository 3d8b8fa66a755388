"""ASGI entry point for the server bin/run starts (uvicorn or daphne): HTTP (API, admin,
dashboard) and the dashboard's WebSocket.

The OpenAI-compatible endpoint (/v1/) and the job API's wait and stream paths are served by
scheduler/gateway before Django sees them: they wait on jobs, and a waiting request there holds no
thread or database connection (see scheduler/gateway/__init__.py)."""

import gc
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "telemachus.settings")

django_asgi_app = get_asgi_application()

# These need the app registry loaded above.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from scheduler.gateway.router import GatewayRouter  # noqa: E402
from scheduler.live.consumers import DashboardConsumer  # noqa: E402
from scheduler.metrics import ResponseCounter  # noqa: E402
from telemachus.http.body_limit import BodyLimit  # noqa: E402
from telemachus.http.reason_phrases import reason_phrases_install  # noqa: E402
from telemachus.http.websocket import SameOriginValidator  # noqa: E402
from telemachus.tracing import tracing_setup  # noqa: E402

# OpenTelemetry traces when OTEL_EXPORTER_OTLP_ENDPOINT is set; nothing at all otherwise.
tracing_setup(service_name="telemachus-api")

# `429 Too Many Requests`, not Twisted's `429 Unknown Status`, on daphne's status lines.
reason_phrases_install()

application = ProtocolTypeRouter(
    {
        # The OpenAI-compatible endpoint, job waits and streams are served ahead of Django (they wait
        # without holding a thread); other API bodies are limited (413) and read, chunked ones
        # included, before Django sees them. Every response is counted by status for /metrics.
        "http": ResponseCounter(GatewayRouter(BodyLimit(django_asgi_app))),
        # Session authentication, as for the page itself; the Origin check (scheme, host and port)
        # stops other sites' pages from opening the socket with a signed-in user's cookie.
        "websocket": SameOriginValidator(
            AuthMiddlewareStack(
                URLRouter(
                    [
                        path("ws/dashboard/", DashboardConsumer.as_asgi()),
                    ]
                )
            )
        ),
    }
)

# What is loaded by now (Django, the apps, the gateway: some 140,000 objects) lives as long as the
# process: moved out of the cyclic collector's sight, a full collection no longer walks it. One
# took 20-70 ms on the 2-vCPU test machine, a pause in whatever requests were in flight, which
# showed in /v1/'s p99; after the freeze it takes microseconds.
gc.freeze()
