"""ASGI entry point for daphne: HTTP (API, admin, dashboard) and, later, WebSocket routes."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "telemachus.settings")

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs the app registry loaded above)

application = ProtocolTypeRouter({"http": django_asgi_app})
