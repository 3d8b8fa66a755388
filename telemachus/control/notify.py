"""Database notifications: every channel, every payload and every sender, in one place.

Senders queue a PostgreSQL NOTIFY inside the transaction that makes the change. PostgreSQL
delivers a NOTIFY issued inside a transaction only when that transaction commits (and never if it
rolls back), so "sent after commit" holds without on-commit hooks, and nobody wakes for a change
they cannot see yet. On SQLite nothing is sent: listeners watch the database file's
`PRAGMA data_version`, which moves on every commit by another connection. Who hears what:
scheduler/notify/listener.py, one listener per process shared by every subscriber.

Channels, their payloads, and who sends them:

  telemachus (WORKERS_CHANNEL): wakes workers; the dashboard listens too
    queued             work entered the queue (submit, requeue, recovery, a released job, a flow's
                       next round)
    freed              slots were freed by someone who will not claim them (cancel, release,
                       recovery, a flow's step, a finish outside a worker or by a worker that is
                       stopping); a worker's own finishes wake only itself, since it has the local
                       room to use what it freed
    config             configuration changed: sent by database triggers on every configuration
                       table, whoever writes (telemachus/control/config.py)
    canceled:<job id>  stop that job's dispatch (scheduler/services/cancel.py)
  telemachus_changes (CHANGES_CHANNEL): live views (the dashboard) re-read; never wakes a worker
    what changed, as a word (claimed, breaker, health, audit); listeners re-read everything
  telemachus_jobs (JOBS_CHANNEL): API processes watching jobs (waits, streams, the
  OpenAI-compatible endpoint: scheduler/notify/feed.py)
    c:<job>:<event>,...  jobs changed, with the latest event of each (every job event but
                         `queued`: scheduler/services/events.py)
    d:<json>             an output delta of a streamed job, when there is no Redis
                         (scheduler/notify/broadcast.py); the one NOTIFY sent outside a
                         transaction, from a connection of its own per worker process

Time frees capacity too (a retry's backoff, a breaker's cooldown, a budget window): the claim
tells the worker when the next of those is due, so nobody needs to send anything for it.

This module is in the lowest layer because every layer sends: configuration triggers and the
audit log here, breaker and health changes in executors, the job services in scheduler."""

from collections.abc import Iterable, Sequence
from typing import Any

import dj_database_url
import psycopg
from django.conf import settings
from django.db import connection
from django.db.models import Func, Value

from telemachus.db.notify import chunked_payloads, notice, notice_column, notices_supported, notify_now
from telemachus.db.statements import Riders

WORKERS_CHANNEL = "telemachus"
QUEUED = "queued"
FREED = "freed"
CONFIG_CHANGED = "config"
CANCELED = "canceled"

CHANGES_CHANNEL = "telemachus_changes"

JOBS_CHANNEL = "telemachus_jobs"
CHANGED, DELTA = "c:", "d:"

# NOTIFYs per statement for the senders that send many at once.
NOTIFY_BATCH = 50


# --- senders inside a transaction -------------------------------------------------------------


def notify_workers(message: str) -> None:
    """Queue a wake-up for workers (`QUEUED`, `FREED`, `f"{CANCELED}:{job_id}"`). Call inside the
    transaction that makes the change; nothing is sent on SQLite."""
    notify_now(WORKERS_CHANNEL, message)


def notify_column(message: str) -> Func | Value:
    """`notify_workers` as a column of a statement the caller runs anyway inside the transaction
    that makes the change, which saves a round trip (a NOTIFY in a transaction that rolls back is
    never delivered). A constant on SQLite."""
    return notice_column(WORKERS_CHANNEL, message)


def changes_notify(what: str) -> None:
    """Tell live views that `what` changed. Call inside the transaction that makes the change;
    nothing is sent on SQLite."""
    notify_now(CHANGES_CHANNEL, what)


def job_watchers_riders(changes: Iterable[tuple[int, str]]) -> Riders:
    """A "changed" notice for API processes watching these jobs, (job id, event) pairs with the
    last event of each job kept, as a rider of the statement that writes the events recording the
    changes (telemachus/db/statements.py), so the notice costs no round trip of its own. Nothing
    on SQLite."""
    latest = dict(changes)
    if not latest or not notices_supported():
        return Riders()
    payloads = chunked_payloads(CHANGED, [f"{job_id}:{event}" for job_id, event in latest.items()])
    return Riders(notices=[notice(JOBS_CHANNEL, payloads)])


# --- senders outside a transaction ------------------------------------------------------------


async def job_deltas_notify(conn: psycopg.AsyncConnection[Any], payloads: Sequence[str]) -> None:
    """Send output deltas (`DELTA` payloads) on an autocommit connection of the caller's, at once:
    deltas are best effort and change no row, so they wait for no commit."""
    for start in range(0, len(payloads), NOTIFY_BATCH):
        sending = notice(JOBS_CHANNEL, payloads[start : start + NOTIFY_BATCH])
        await conn.execute(sending.sql, sending.params)


# --- connections of their own -----------------------------------------------------------------


def listen_connection_params() -> dict[str, Any]:
    """Parameters for the LISTEN connection (psycopg.connect keywords). LISTEN needs a session of
    its own on the server, which a transaction-pooling PgBouncer does not give: a deployment behind
    one sets TELEMACHUS_LISTEN_DATABASE_URL to reach PostgreSQL directly; otherwise, the database
    Django uses."""
    url = getattr(settings, "TELEMACHUS_LISTEN_DATABASE_URL", "")
    if not url:
        return notify_connection_params()
    config = dj_database_url.parse(url)
    params: dict[str, Any] = {
        # The database is always Django's own (a test run's renamed one included): the URL says
        # only how to reach its server directly.
        "dbname": connection.settings_dict["NAME"],
        "user": config.get("USER"),
        "password": config.get("PASSWORD"),
        "host": config.get("HOST"),
        "port": config.get("PORT"),
        "client_encoding": "UTF8",
        **dict(config.get("OPTIONS") or {}),
    }
    return {k: v for k, v in params.items() if v not in (None, "")}


def notify_connection_params() -> dict[str, Any]:
    """Parameters for a separate psycopg connection to the database Django uses (the delta
    sender's, which NOTIFYs outside any transaction). Django's `prepare_threshold` stays (5 on a
    direct connection, None behind PgBouncer: settings.py): psycopg's own default prepares a
    statement run 5 times, and behind a transaction-pooling PgBouncer before 1.21 the next run
    lands on a server connection that never saw it ("prepared statement ... does not exist")."""
    return {k: v for k, v in connection.get_connection_params().items() if k not in {"cursor_factory", "context"}}
