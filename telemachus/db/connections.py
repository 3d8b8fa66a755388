"""Whether this thread's database connection can serve the next statement, and whether a failed
statement never ran.

A thread that keeps its connection open across calls (the API process's shared database threads,
a worker's own thread) meets connections the server ended while they sat idle: an operator's
`pg_terminate_backend`, a failover, a pooler or a firewall closing idle sessions. Django finds out
only when the next statement fails, and that statement may be the read an in-flight call needs for
its answer. The server says goodbye before it closes (a FATAL message, then the end of the stream),
so an idle connection with something to read has been ended: `connection_refresh` looks (a
zero-timeout poll of the socket, about a microsecond) and closes it, and the call opens a new one.
What it cannot see (an end that arrives between the look and the statement) `statement_not_run`
recognises afterwards, for the caller to decide whether the statement may be sent again."""

import select

import psycopg
from django.db import DatabaseError, connection

# The server ended the session (admin_shutdown, crash_shutdown, cannot_connect_now): whatever the
# session had not committed was rolled back, so the statement that met the error did not take effect.
_SESSION_ENDED = frozenset({"57P01", "57P02", "57P03"})


def connection_refresh() -> None:
    """Close this thread's connection when it cannot serve another statement (Django reopens it on
    the next): after an error, when it no longer answers; when idle, when the server has ended it.
    Inside a transaction nothing is closed: the transaction's own statements say how it went."""
    if connection.connection is None or connection.in_atomic_block:
        return
    if connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()
        return
    if connection.vendor == "postgresql" and _ended_by_server(connection.connection):
        connection.close()


def _ended_by_server(conn: psycopg.Connection) -> bool:
    """Whether an idle psycopg connection has heard from the server. Nothing is due on an idle
    connection but the server's goodbye (these threads never LISTEN; the listener has a connection
    of its own), so anything to read means the session is over, or as good as: the rare other
    message (a setting the server reports changed) costs a reconnect, nothing more."""
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def statement_not_run(exc: DatabaseError) -> bool:
    """Whether a statement that failed with `exc` certainly did not take effect, so sending it again
    on a new connection cannot apply it twice: the server ended the session (what it had not
    committed was rolled back), or the connection was known closed before the statement was sent."""
    cause = exc.__cause__
    sqlstate = getattr(getattr(cause, "diag", None), "sqlstate", None) or getattr(cause, "sqlstate", None)
    if sqlstate in _SESSION_ENDED:
        return True
    return "connection is closed" in str(exc)
