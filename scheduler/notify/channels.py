"""Notifications through the database, sent inside the transaction that makes the change. On
PostgreSQL a NOTIFY issued inside a transaction is delivered only when it commits, so nobody wakes
for a change they cannot yet see; on SQLite there is no NOTIFY, and listeners watch the database
file's `PRAGMA data_version`, which moves on every commit.

Two channels. `telemachus` wakes workers; what wakes a worker, and who sends it:
  queued    work entered the queue (submit, requeue, recovery, release)
  freed     slots were freed by someone who will not claim them (cancel, release, recovery, a
            flow's step, a finish outside a worker or by a worker that is stopping); a worker's
            own finishes wake only itself, since it has the local room to use what it freed
  config    configuration changed (telemachus/control/config.py: sent by database triggers, whoever
            writes): a cap raised, an executor added, enabled or back in health, a breaker closed
  canceled:<job id>  stop that job's dispatch
Time frees capacity too (a retry's backoff, a breaker's cooldown, a budget window): the claim tells
the worker when the next of those is due (`ClaimBatch.wake_in`), so nobody needs to send anything.

`telemachus_jobs` tells API processes that jobs they may be watching changed (waits, streams, the
OpenAI-compatible endpoint: scheduler/gateway/feed.py) and, when there is no Redis, carries
streamed output deltas (scheduler/notify/broadcast.py)."""

from collections.abc import Iterable
from typing import Any

from django.db import connection
from django.db.models import Func, TextField, Value

from telemachus.control.config import CHANNEL, CONFIG_CHANGED

QUEUED = "queued"
FREED = "freed"
CANCELED = "canceled"
CONFIG = CONFIG_CHANGED

JOBS_CHANNEL = "telemachus_jobs"
# Payloads on JOBS_CHANNEL: "c:<job>:<event>,<job>:<event>,..." (jobs changed, with the latest
# event of each) and "d:<json>" (an output delta, see broadcast.py).
CHANGED, DELTA = "c:", "d:"
# PostgreSQL refuses payloads of 8000 bytes or more.
MAX_PAYLOAD_BYTES = 7900


def notify_workers(message: str) -> None:
    """Queue a wake-up for LISTENing workers. Call inside the transaction that makes the change."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, message])


def notify_job_watchers(changes: Iterable[tuple[int, str]]) -> None:
    """Queue a "changed" notice for API processes watching these jobs: (job id, event) pairs, the
    last event of each job kept. One statement per call, however many jobs. Call inside the
    transaction that makes the change; nothing is sent on other databases (see module doc)."""
    if connection.vendor != "postgresql":
        return
    latest = dict(changes)
    if not latest:
        return
    payloads = chunked_payloads(CHANGED, [f"{job_id}:{event}" for job_id, event in latest.items()])
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT " + ", ".join(["pg_notify(%s, %s)"] * len(payloads)),
            [value for payload in payloads for value in (JOBS_CHANNEL, payload)],
        )


def chunked_payloads(prefix: str, items: list[str]) -> list[str]:
    """Comma-joined items behind `prefix`, split so no payload reaches PostgreSQL's limit."""
    payloads, current = [], prefix
    for item in items:
        if len(current) + len(item) + 1 > MAX_PAYLOAD_BYTES and current != prefix:
            payloads.append(current[:-1])
            current = prefix
        current += item + ","
    if current != prefix:
        payloads.append(current[:-1])
    return payloads


def listen_connection_params() -> dict[str, Any]:
    """Parameters for a separate psycopg connection (LISTEN, or NOTIFY outside transactions) to
    the same database as Django's."""
    return {
        k: v
        for k, v in connection.get_connection_params().items()
        if k not in {"cursor_factory", "context", "prepare_threshold"}
    }


def notify_column(message: str) -> Func | Value:
    """`notify_workers` as a column of a statement the caller runs anyway inside the transaction
    that makes the change, which saves a round trip (a NOTIFY in a transaction that rolls back is
    never delivered). A constant on SQLite."""
    if connection.vendor == "postgresql":
        return Func(Value(CHANNEL), Value(message), function="pg_notify", output_field=TextField())
    return Value("", output_field=TextField())
