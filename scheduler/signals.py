"""Wake-ups for workers. On PostgreSQL a NOTIFY issued inside a transaction is delivered only when it
commits, so a worker never wakes for work it cannot yet see; on SQLite workers watch the database
file's `data_version`, which moves on every commit.

What wakes a worker, and who sends it:
  queued    work entered the queue (submit, requeue, recovery, release)
  freed     slots were freed by someone who will not claim them (cancel, release, recovery, a
            flow's step, a finish outside a worker or by a worker that is stopping); a worker's
            own finishes wake only itself, since it has the local room to use what it freed
  config    configuration changed (telemachus/config.py: sent by database triggers, whoever
            writes): a cap raised, an executor added, enabled or back in health, a breaker closed
  canceled:<job id>  stop that job's dispatch
Time frees capacity too (a retry's backoff, a breaker's cooldown, a budget window): the claim tells
the worker when the next of those is due (`ClaimBatch.wake_in`), so nobody needs to send anything."""

from django.db import connection
from django.db.models import Func, TextField, Value

from telemachus.config import CHANNEL, CONFIG_CHANGED

QUEUED = "queued"
FREED = "freed"
CANCELED = "canceled"
CONFIG = CONFIG_CHANGED


def notify_workers(message: str) -> None:
    """Queue a wake-up for LISTENing workers. Call inside the transaction that makes the change."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, message])


def notify_column(message: str) -> Func | Value:
    """`notify_workers` as a column of a statement the caller runs anyway inside the transaction
    that makes the change, which saves a round trip (a NOTIFY in a transaction that rolls back is
    never delivered). A constant on SQLite."""
    if connection.vendor == "postgresql":
        return Func(Value(CHANNEL), Value(message), function="pg_notify", output_field=TextField())
    return Value("", output_field=TextField())
