"""Change notifications for live views (the dashboard), beside the workers' wake-ups.

On PostgreSQL a NOTIFY issued inside a transaction is delivered when it commits, so a listener
never re-reads before the change is visible; on SQLite listeners watch `PRAGMA data_version`,
which moves on every commit, so nothing needs sending. A separate channel from the workers' one
(scheduler/notify/channels.py), so a dashboard-only change never wakes a worker."""

from django.db import connection

CHANNEL = "telemachus_changes"


def changes_notify(what: str) -> None:
    """Tell live views that `what` changed. Call inside the transaction that makes the change."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, what])
