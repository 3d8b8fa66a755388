"""PostgreSQL's NOTIFY and LISTEN as statements. Which channels exist, what their payloads say
and who sends them is telemachus/control/notify.py's to say; this is only how they are sent.

A NOTIFY issued inside a transaction is delivered when it commits (never if it rolls back), so a
sender inside the transaction that makes a change needs no on-commit hook. SQLite has no
notifications: `notice` is None there, and listeners watch `PRAGMA data_version` instead
(scheduler/notify/listener.py)."""

from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.db.models import Func, TextField, Value
from psycopg import sql

from telemachus.db.statements import Statement

# PostgreSQL refuses payloads of 8000 bytes or more.
MAX_PAYLOAD_BYTES = 7900


def notices_supported() -> bool:
    return connection.vendor == "postgresql"


def notice(channel: str, payloads: Sequence[str]) -> Statement:
    """One SELECT that sends every payload on `channel`."""
    return Statement(
        "SELECT " + ", ".join(["pg_notify(%s, %s)"] * len(payloads)),
        [value for payload in payloads for value in (channel, payload)],
    )


def notify_now(channel: str, payload: str) -> None:
    """Send one payload from inside the caller's transaction (at its commit); nothing on SQLite."""
    if notices_supported():
        notice(channel, [payload]).run()


def notice_column(channel: str, payload: str) -> Func | Value:
    """The same as a column of a statement the caller runs anyway inside the transaction (a round
    trip saved); a constant on SQLite."""
    if notices_supported():
        return Func(Value(channel), Value(payload), function="pg_notify", output_field=TextField())
    return Value("", output_field=TextField())


def notice_returning(channel: str, payload: str) -> tuple[str, list[Any]]:
    """The same as an expression of a RETURNING clause: `pg_notify(%s, %s)` and its parameters
    (PostgreSQL only; check `notices_supported` first)."""
    return "pg_notify(%s, %s)", [channel, payload]


def chunked_payloads(prefix: str, items: list[str]) -> list[str]:
    """Comma-joined items behind `prefix`, split so no payload reaches PostgreSQL's limit."""
    payloads: list[str] = []
    current = prefix
    for item in items:
        if len(current) + len(item) + 1 > MAX_PAYLOAD_BYTES and current != prefix:
            payloads.append(current[:-1])
            current = prefix
        current += item + ","
    if current != prefix:
        payloads.append(current[:-1])
    return payloads


def listen(channel: str, *, stop: bool = False) -> sql.Composed:
    """LISTEN (or, with `stop`, UNLISTEN) on a channel, for a listening connection of psycopg's."""
    return sql.SQL("UNLISTEN {}" if stop else "LISTEN {}").format(sql.Identifier(channel))


# SQLite's counterpart of a notification: a number that moves whenever another connection commits.
DATA_VERSION = "PRAGMA data_version"
