"""The live dashboard's WebSocket (/ws/dashboard/): pushes the dashboard state (the queue snapshot
as GET /api/queue/ returns it, the page of jobs the page chose, the policy and the feature
switches) each time the database changes, and carries operators' actions (scheduler/live/actions.py).

The page chooses its page of jobs with `{"id": ..., "view": {tab, team, type, model, executor,
after, size}}` (scheduler/live/joblist.py), anyone signed in, members too; the reply echoes `id` and
the next push carries that page.

Re-reads are driven by change notifications, coalesced over a short window, not by a timer per
socket: each socket subscribes to the process's listener (scheduler/notify/listener.py) for the
workers' channel (work queued, capacity freed, a job canceled, configuration changed) and the
live-view channel (claims, breaker and health changes, audited operator changes), or on SQLite
for its data_version watch. The channel layer carries the dashboard's own actions
(broadcast.dashboard_changed_send), across processes when it is Redis. A heartbeat every few
seconds tells the page that the picture it shows is still current (the "updated" stamp); when
notifications cannot be heard, or a reason in the picture has a deadline (a breaker cooldown, a
budget reset), the heartbeat re-reads instead."""

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import import_module
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import SESSION_KEY, get_user_model
from django.core.serializers.json import DjangoJSONEncoder
from django.db import DatabaseError
from django.utils import timezone

from scheduler.live.actions import dashboard_action
from scheduler.live.joblist import JobView, JobViewInput
from scheduler.live.snapshot import dashboard_state
from scheduler.notify import broadcast
from scheduler.notify.listener import Listener, Subscription
from telemachus.control import notify
from telemachus.errors import ValidationFailed
from telemachus.http.parsers import json_parse, json_problem

log = logging.getLogger("telemachus.dashboard")
NOT_AUTHENTICATED = 4401
# A burst of commits (a claim of 64 jobs, a bulk submit) becomes one re-read.
COALESCE_SECONDS = 0.1
# Re-read at least this often even when notifications say nothing changed.
REREAD_SECONDS = 60.0
# SQLite: how often the listener looks for commits while a dashboard is open.
SQLITE_WATCH_SECONDS = 0.05


class DashboardEars:
    """A socket's subscription to the listener: any change it hears wakes the socket's pusher."""

    def __init__(self, wake: asyncio.Event) -> None:
        self.wake = wake

    def notified(self, channel: str, payload: str) -> None:
        self.wake.set()

    def missed(self) -> None:
        self.wake.set()

    def live_changed(self, live: bool) -> None:
        """The pusher reads `live` when its heartbeat comes round."""


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    pusher: asyncio.Task | None = None
    wake: asyncio.Event | None = None
    ears: Subscription | None = None
    view: JobView = JobView()

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=NOT_AUTHENTICATED)
            return
        await self.accept()
        self.wake = asyncio.Event()
        self.ears = Listener.current().subscribe(
            DashboardEars(self.wake),
            channels=[notify.WORKERS_CHANNEL, notify.CHANGES_CHANNEL],
            sqlite_interval=SQLITE_WATCH_SECONDS,
        )
        await self.channel_layer.group_add(broadcast.DASHBOARD_GROUP, self.channel_name)
        self.pusher = asyncio.create_task(self._push(user, self.scope["session"].session_key))

    async def disconnect(self, code: int) -> None:
        if self.pusher is not None:
            self.pusher.cancel()
        if self.ears is not None:
            self.ears.close()
            await self.channel_layer.group_discard(broadcast.DASHBOARD_GROUP, self.channel_name)

    async def dashboard_changed(self, message: dict[str, Any]) -> None:
        if self.wake is not None:
            self.wake.set()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """An action: `{"id": <anything>, "action": "...", ...}`; the reply echoes `id`. Members
        (and anyone signed out since) are refused with 403 forbidden, as by the API. A view
        (`{"id": ..., "view": {...}}`) changes what this socket's pushes list, nothing else. A
        message the API's parser would refuse (a number that is not finite, text PostgreSQL
        cannot store, nesting past its limit) is answered with its validation error, naming the
        JSON path."""
        if isinstance(content, Unparsable):
            await self.send_json({"reply": None, "ok": False, "error": content.error})
            return
        if isinstance(content, dict) and "view" in content:
            await self._view_set(content)
            return
        user = await database_sync_to_async(_user_for)(
            user_id=self.scope["user"].pk, session_key=self.scope["session"].session_key
        )
        if user is None:
            reply = {"ok": False, "error": {"error": "not_authenticated", "detail": "Sign in again."}}
        else:
            try:
                reply = await database_sync_to_async(dashboard_action)(user=user, message=content)
            except Exception:
                # A bug, not the operator's input: say so and keep the socket (and its pushes) open.
                log.exception("dashboard action failed: %.200r", content)
                reply = {"ok": False, "error": {"error": "server_error", "detail": "The action failed."}}
        await self.send_json({"reply": content.get("id") if isinstance(content, dict) else None, **reply})
        if reply["ok"]:
            await broadcast.dashboard_changed_send()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any) -> None:
        """Actions are JSON text frames; a binary or empty frame is answered as an invalid
        action, where channels would raise and close the socket with 1011."""
        if not text_data:
            await self.receive_json(None)
            return
        await super().receive(text_data=text_data, **kwargs)

    async def _view_set(self, content: dict[str, Any]) -> None:
        data = content["view"]
        chosen = JobViewInput(data=data if isinstance(data, dict) else {})
        if not isinstance(data, dict) or not chosen.is_valid():
            refused = ValidationFailed(chosen.errors if isinstance(data, dict) else {"view": ["An object."]})
            await self.send_json({"reply": content.get("id"), "ok": False, "error": refused.body()})
            return
        self.view = chosen.view()
        await self.send_json({"reply": content.get("id"), "ok": True})
        if self.wake is not None:
            self.wake.set()

    async def _push(self, user: Any, session_key: str | None) -> None:
        state = database_sync_to_async(_state_for)
        heartbeat = settings.TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS
        last, read_at, deadline = None, 0.0, None
        reread = True
        while True:
            if reread:
                try:
                    current = await state(user_id=user.pk, session_key=session_key, view=self.view)
                except Exception as exc:
                    # The page keeps its last picture and says when it was taken; try again shortly. A
                    # database outage is expected now and then; anything else is a bug worth a traceback.
                    log.warning("dashboard snapshot failed (%s)", exc, exc_info=not isinstance(exc, DatabaseError))
                    await asyncio.sleep(heartbeat)
                    continue
                if current is None:  # signed out, deactivated or deleted since the page opened
                    await self.close(code=NOT_AUTHENTICATED)
                    return
                read_at, deadline = time.monotonic(), _next_deadline(current)
                encoded = await self.encode_json(current)
                stamp = timezone.now().isoformat()
                if encoded != last:
                    last = encoded
                    await self.send(text_data=f'{{"at": "{stamp}", "state": {encoded}}}')
                else:
                    await self.send(text_data=json.dumps({"at": stamp}))
            else:
                await self.send(text_data=json.dumps({"at": timezone.now().isoformat()}))
            timeout = heartbeat if deadline is None else max(min(heartbeat, deadline - time.time()), 0.05)
            try:
                await asyncio.wait_for(self.wake.wait(), timeout)  # type: ignore[union-attr]
                await asyncio.sleep(COALESCE_SECONDS)
                reread = True
            except TimeoutError:
                reread = (
                    not self.ears.live  # type: ignore[union-attr]
                    or time.monotonic() - read_at >= REREAD_SECONDS
                    or (deadline is not None and time.time() >= deadline)
                )
            self.wake.clear()  # type: ignore[union-attr]

    @classmethod
    async def decode_json(cls, text_data: str) -> Any:
        """The message as the API's parser reads a body (telemachus/http/parsers.py). Malformed
        JSON is an invalid action (answered), not a reason to drop the connection; so is JSON the
        API refuses, which comes back as `Unparsable`."""
        try:
            content = json_parse(text_data)
        except (ValueError, RecursionError):
            return None
        problem = json_problem(content)
        if problem is None:
            return content
        path, message = problem
        return Unparsable(ValidationFailed({path or "message": [message]}).body())

    @classmethod
    async def encode_json(cls, content: Any) -> str:
        return json.dumps(content, cls=DjangoJSONEncoder, sort_keys=True)


@dataclass(frozen=True)
class Unparsable:
    """A message refused before any action looks at it, and the error to answer it with."""

    error: dict[str, Any]


def _next_deadline(state: dict[str, Any]) -> float | None:
    """The earliest future moment (epoch seconds) at which a reason in the picture expires by
    itself (a breaker cooldown, a budget window, a retry backoff): re-read then."""
    now, soonest = time.time(), None
    found: list[Any] = []
    for team in state["queue"]["teams"]:
        found += [w.get("reset_at") or w.get("until") for w in team["waits"]]
    found += [e["breaker_until"] for e in state["queue"]["executors"]]
    for value in found:
        if value is None:
            continue
        moment = (value if isinstance(value, datetime) else datetime.fromisoformat(value)).timestamp()
        if moment > now and (soonest is None or moment < soonest):
            soonest = moment
    return soonest


def _user_for(*, user_id: int, session_key: str | None) -> Any:
    """The session and the user are read again each time, so signing out (anywhere) or a
    deactivated account stops the updates and the actions at once, and changes to teams and roles
    show at the next one."""
    session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    if session_key is None or session.get(SESSION_KEY) != str(user_id):
        return None
    return get_user_model().objects.filter(pk=user_id, is_active=True).first()


def _state_for(*, user_id: int, session_key: str | None, view: JobView) -> dict[str, Any] | None:
    user = _user_for(user_id=user_id, session_key=session_key)
    return dashboard_state(user=user, view=view) if user is not None else None
