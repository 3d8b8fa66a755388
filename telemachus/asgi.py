"""ASGI entry point for daphne: HTTP (API, admin, dashboard) and the dashboard's WebSocket."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "telemachus.settings")

django_asgi_app = get_asgi_application()

# These need the app registry loaded above.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from scheduler.consumers import DashboardConsumer  # noqa: E402
from telemachus.body_limit import BodyLimit  # noqa: E402
from telemachus.websocket import SameOriginValidator  # noqa: E402

application = ProtocolTypeRouter({
    # API bodies are limited (413) and read here, chunked ones included, before Django sees them.
    "http": BodyLimit(django_asgi_app),
    # Session authentication, as for the page itself; the Origin check (scheme, host and port)
    # stops other sites' pages from opening the socket with a signed-in user's cookie.
    "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter([
        path("ws/dashboard/", DashboardConsumer.as_asgi()),
    ]))),
})
