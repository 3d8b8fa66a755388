"""How many round trips to PostgreSQL a block of code makes, read from libpq's protocol trace."""

import tempfile
from collections.abc import Callable
from typing import Any

from django.db import connection


def round_trips(block: Callable[[], Any]) -> int:
    """Each run of messages this connection sends before it reads the server's answer is one
    round trip (a pipeline's statements and their Sync count once)."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            block()
        finally:
            pgconn.untrace()  # flushes the trace
        trace.seek(0)
        sides = [_side(line) for line in trace if line.strip()]
    return sum(1 for before, side in zip(["B", *sides], sides, strict=False) if before == "B" and side == "F")


def _side(line: str) -> str:
    """F (from the client, frontend) or B (from the server, backend): the field after the time."""
    fields = line.split("\t")
    return fields[1] if fields[0] not in ("F", "B") else fields[0]
