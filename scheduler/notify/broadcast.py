"""Streamed output, from the worker that runs a job to the API processes that relay it (the
OpenAI-compatible endpoint's `stream: true`, `GET /api/jobs/{id}/stream/`). Group names and
payloads are defined here and nowhere else. Sends are best effort: a lost delta never changes a
job, and the receivers fill any gap from the job's final result (scheduler/gateway/).

Where deltas travel (`delta_transport()`, the same answer in every process of a deployment):

* `REDIS_URL` set: the channel layer (channels-redis), to the group `job-<id>`.
* PostgreSQL without Redis: NOTIFY on the jobs' channel (telemachus/control/notify.py), from one
  connection per worker process, outside any transaction.
* otherwise (SQLite without Redis): the in-memory channel layer, which reaches only the process
  it is in; API processes then see a streamed job's text when the job ends.

A delta is `{"job", "attempt", "offset", "text"}`: `offset` is where `text` starts in the
attempt's output, so a receiver can tell a missed delta from the next one and a retry (a new
attempt starts again at 0) from more output. A piece of a tool call's arguments is a delta of
its own `part`, `"tool:<index>"`, with offsets of its own and the call's `id` and `name` as far
as known; a delta without `part` is the reply's text. A flow's round (scheduler/flows/runner.py)
adds `round`: its attempts are counted per round, so offsets are per round and attempt. Deltas are
coalesced per job while a send is in flight, so a fast model does not cost one message per token."""

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import psycopg
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection

from telemachus.control import notify
from telemachus.db.notify import MAX_PAYLOAD_BYTES

log = logging.getLogger("telemachus.broadcast")
LAYER, POSTGRES = "layer", "postgres"


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


def delta_transport() -> str:
    if settings.REDIS_URL or connection.vendor != "postgresql":
        return LAYER
    return POSTGRES


def delta_message(
    *,
    job_id: int,
    attempt: int,
    offset: int,
    text: str,
    part: str = "",
    head: tuple[str, str] | None = None,
    round: int = 0,
) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "job.delta", "job": job_id, "attempt": attempt, "offset": offset, "text": text}
    if round:
        message["round"] = round
    if part:
        message.update(part=part, id=head[0] if head else "", name=head[1] if head else "")
    return message


def tool_part(index: int) -> str:
    """The part of a delta that is a piece of the arguments of tool call `index`."""
    return f"tool:{index}"


@dataclass
class _Pending:
    offset: int
    parts: list[str] = field(default_factory=list)
    head: tuple[str, str] | None = None  # a tool call's id and name, the latest known


class DeltaPublisher:
    """One per worker process (its event loop). `publish()` never waits: it queues the text and a
    single sender task ships what has accumulated, one round of messages at a time, so a job's
    deltas leave in order and a slow channel slows nobody's model stream."""

    _instances: dict[asyncio.AbstractEventLoop, "DeltaPublisher"] = {}

    def __init__(self) -> None:
        self.transport = delta_transport()
        self._pending: dict[tuple[int, int, int, str], _Pending] = {}  # (job, round, attempt, part)
        self._sending: set[int] = set()
        self._ready = asyncio.Event()
        self._round_over = asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._conn: psycopg.AsyncConnection | None = None

    @classmethod
    def current(cls) -> "DeltaPublisher":
        loop = asyncio.get_running_loop()
        publisher = cls._instances.get(loop)
        if publisher is None:
            cls._instances = {lp: p for lp, p in cls._instances.items() if not lp.is_closed()}
            publisher = cls._instances[loop] = cls()
        return publisher

    def publish(
        self,
        *,
        job_id: int,
        attempt: int,
        offset: int,
        text: str,
        part: str = "",
        head: tuple[str, str] | None = None,
        round: int = 0,
    ) -> None:
        key = (job_id, round, attempt, part)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(offset=offset)
        pending.parts.append(text)
        pending.head = head or pending.head
        self._ready.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_forever(), name="delta-publisher")

    async def flush(self, job_id: int, *, timeout: float = 1.0) -> None:
        """Wait (briefly) until the job's deltas have left, so they go out before its end does."""
        try:
            async with asyncio.timeout(timeout):
                while job_id in self._sending or any(key[0] == job_id for key in self._pending):
                    self._round_over.clear()
                    await self._round_over.wait()
        except TimeoutError:
            log.warning("job %d: output deltas still unsent after %.1fs", job_id, timeout)

    async def _send_forever(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._pending = self._pending, {}
            self._sending = {job_id for job_id, _, _, _ in batch}
            messages = [
                delta_message(
                    job_id=job_id,
                    attempt=attempt,
                    offset=p.offset,
                    text="".join(p.parts),
                    part=part,
                    head=p.head,
                    round=round,
                )
                for (job_id, round, attempt, part), p in batch.items()
            ]
            try:
                if self.transport == POSTGRES:
                    await self._notify(messages)
                else:
                    layer = get_channel_layer()
                    await asyncio.gather(*(layer.group_send(job_group(m["job"]), m) for m in messages))
            except Exception as exc:  # a live relay must never fail a model call
                log.warning("could not send %d output delta(s): %s", len(messages), exc)
                await self._close()
            self._sending = set()
            self._round_over.set()

    async def _notify(self, messages: list[dict[str, Any]]) -> None:
        payloads = [p for m in messages for p in _delta_payloads(m)]
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(**notify.notify_connection_params(), autocommit=True)
        await notify.job_deltas_notify(self._conn, payloads)

    async def _close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            try:
                await conn.close()
            except Exception:
                pass


def _delta_payloads(message: dict[str, Any]) -> list[str]:
    """A delta as NOTIFY payloads under PostgreSQL's size limit: long text is split in pieces
    that each carry their own offset."""
    text, offset, payloads = message["text"], message["offset"], []
    step = MAX_PAYLOAD_BYTES // 13  # JSON may spend 12 bytes on one character; room for the rest
    for start in range(0, max(len(text), 1), step):
        piece = {**message, "offset": offset + start, "text": text[start : start + step]}
        del piece["type"]
        payloads.append(notify.DELTA + json.dumps(piece, separators=(",", ":")))
    return payloads


class DeltaStream:
    """What the worker hands a streaming dispatch (a `DeltaSink`): each delta of the attempt's
    output goes out, numbered by where it starts (and, for a flow, tagged with its round).
    `flush()` before reporting the attempt's end."""

    def __init__(self, job_id: int, *, attempt: int, round: int = 0) -> None:
        self.job_id, self.attempt, self.round, self.sent = job_id, attempt, round, 0
        self.tool_sent: dict[int, int] = {}  # tool call index -> length of its arguments sent
        self.publisher = DeltaPublisher.current()

    async def __call__(self, text: str, *, tool: tuple[int, str, str] | None = None) -> None:
        if tool is not None:
            index, ident, name = tool
            offset = self.tool_sent.get(index, 0)
            self.publisher.publish(
                job_id=self.job_id,
                attempt=self.attempt,
                offset=offset,
                text=text,
                part=tool_part(index),
                head=(ident, name),
                round=self.round,
            )
            self.tool_sent[index] = offset + len(text)
            return
        self.publisher.publish(job_id=self.job_id, attempt=self.attempt, offset=self.sent, text=text, round=self.round)
        self.sent += len(text)

    async def flush(self) -> None:
        await self.publisher.flush(self.job_id)


DASHBOARD_GROUP = "dashboard"


async def dashboard_changed_send() -> None:
    """Tell every open dashboard (in every process, with a Redis layer) to re-read now: sent after
    a dashboard action commits."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        await layer.group_send(DASHBOARD_GROUP, {"type": "dashboard.changed"})
    except Exception:
        log.warning("could not tell dashboards of a change", exc_info=True)
