"""Wake-ups for workers. On PostgreSQL a NOTIFY issued inside a transaction is delivered only when it
commits, so a worker never wakes for work it cannot yet see; on SQLite workers poll."""

from django.db import connection

CHANNEL = "telemachus"
QUEUED = "queued"
FREED = "freed"
CANCELED = "canceled"


def notify_workers(message: str) -> None:
    """Queue a wake-up for LISTENing workers. Call inside the transaction that makes the change."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, message])
