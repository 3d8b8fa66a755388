"""The live dashboard's WebSocket (/ws/dashboard/): pushes the queue snapshot (what GET /api/queue/
returns) and the latest jobs the user may see, each time they change.

It reads the database on a short interval instead of listening on the channel layer: workers are
other processes, often on other hosts, and the default in-memory layer does not cross processes.
A snapshot a second per open dashboard is cheap next to the claims, and it cannot miss an update."""

import asyncio
import json
import logging
import time
from importlib import import_module
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError
from django.utils import timezone

from scheduler.snapshot import dashboard_state

log = logging.getLogger("telemachus.dashboard")
# Sent even when nothing changed, so the page can tell a quiet queue from a dead connection.
KEEPALIVE_SECONDS = 15.0
NOT_AUTHENTICATED = 4401


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    pusher: asyncio.Task | None = None

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=NOT_AUTHENTICATED)
            return
        await self.accept()
        self.pusher = asyncio.create_task(self._push(user, self.scope["session"].session_key))

    async def disconnect(self, code: int) -> None:
        if self.pusher is not None:
            self.pusher.cancel()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The dashboard only listens; anything sent to it is ignored."""

    async def _push(self, user: Any, session_key: str | None) -> None:
        state = database_sync_to_async(_state_for)
        last, sent_at = None, 0.0
        while True:
            try:
                current = await state(user_id=user.pk, session_key=session_key)
                if current is None:  # signed out, deactivated or deleted since the page opened
                    await self.close(code=NOT_AUTHENTICATED)
                    return
                encoded = await self.encode_json(current)
            except Exception as exc:
                # The page keeps its last picture and says when it was taken; try again shortly. A
                # database outage is expected now and then; anything else is a bug worth a traceback.
                log.warning("dashboard snapshot failed (%s)", exc, exc_info=not isinstance(exc, DatabaseError))
                await asyncio.sleep(max(settings.TELEMACHUS_DASHBOARD_INTERVAL_SECONDS, 1.0))
                continue
            if encoded != last or time.monotonic() - sent_at >= KEEPALIVE_SECONDS:
                last, sent_at = encoded, time.monotonic()
                await self.send(text_data=f'{{"at": "{timezone.now().isoformat()}", "state": {encoded}}}')
            await asyncio.sleep(settings.TELEMACHUS_DASHBOARD_INTERVAL_SECONDS)

    @classmethod
    async def encode_json(cls, content: Any) -> str:
        return json.dumps(content, cls=DjangoJSONEncoder, sort_keys=True)


def _state_for(*, user_id: int, session_key: str | None) -> dict[str, Any] | None:
    """The session and the user are read again each time, so signing out (anywhere) or a
    deactivated account stops the updates at once, and changes to teams and roles show at the
    next one."""
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    if session_key is None or session.get(SESSION_KEY) != str(user_id):
        return None
    user = get_user_model().objects.filter(pk=user_id, is_active=True).first()
    return dashboard_state(user=user) if user is not None else None
