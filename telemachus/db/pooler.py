"""Whether a PostgreSQL connection goes through a connection pooler (PgBouncer, or any other that
hands out server connections), and what is wrong when the settings do not say so.

Behind a transaction pooler without TELEMACHUS_PGBOUNCER the app starts, then about every other
request fails: a statement prepared on one server connection is executed on another (`prepared
statement "_pg3_4" does not exist`, `bind message supplies 1 parameters, but prepared statement
requires 44`), and the worker's connection is refused (`unsupported startup parameter: options`).
The start-up check (telemachus/startup.py) and /readyz find it here first.

How: a client learns its server process's pid at connect, from the protocol's BackendKeyData
message (what it would send to cancel a query), and `pg_backend_pid()` says which process ran a
query. Straight to PostgreSQL the two are the same process. A pooler answers the connect itself,
with a key of its own making (PgBouncer's is random), and runs the query on whichever server
connection it picked, so the two differ. One connection and one query decide it, at any load,
with any pool size. Comparing two transactions' `pg_backend_pid()` on one client connection
does not: an idle pooler hands the same server connection back (PgBouncer's default is
last-in-first-out), so a transaction pooler looks direct until it is busy (measured on
bin/pgbouncer-test: three transactions, one pid). The comparison cannot tell transaction from
session pooling; TELEMACHUS_PGBOUNCER=1 is right behind both (it only gives up what a transaction
pooler breaks), so any pooler asks for it."""

from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import connection

from telemachus.db.statements import Statement

# One round trip: the server process, and PostgreSQL's own address as it saw this connection
# (through a pooler: the address the pooler reached it at; NULL over a Unix socket).
ROUTE_QUERY = "SELECT pg_backend_pid(), host(inet_server_addr()), inet_server_port()"
CONNECT_TIMEOUT = 5


@dataclass(frozen=True)
class Route:
    """How a connection reaches PostgreSQL: `pooled` through a pooler or not; `server` is
    PostgreSQL's address as PostgreSQL saw the connection ("host:port", "" over a Unix socket)."""

    pooled: bool
    server: str


def route_read(*, protocol_pid: int, row: tuple[Any, ...]) -> Route:
    """The route from a connection's BackendKeyData pid and ROUTE_QUERY's row run on it."""
    pid, host, port = row
    return Route(pooled=pid != protocol_pid, server=f"{host}:{port}" if host else "")


def route_probe(params: dict[str, Any]) -> Route:
    """Open a connection with `params` (psycopg.connect keywords), read its route, close it.
    Raises psycopg.OperationalError when it cannot connect (within CONNECT_TIMEOUT)."""
    params = {"connect_timeout": CONNECT_TIMEOUT, **params, "autocommit": True}
    with psycopg.connect(**params) as conn:
        row = conn.execute(ROUTE_QUERY, prepare=False).fetchone()
        assert row is not None
        return route_read(protocol_pid=conn.info.backend_pid, row=row)


def listen_url_suggested(*, route: Route | None, user: str, name: str) -> str:
    """A TELEMACHUS_LISTEN_DATABASE_URL to suggest: PostgreSQL's own address as it reported it."""
    server = (route.server if route else "") or "POSTGRES_HOST:5432"
    return f"postgres://{user or 'USER'}:PASSWORD@{server}/{name}"


def pooler_unflagged(*, where: str, route: Route | None, user: str, name: str, symptom: str = "") -> str:
    """What to say when DATABASE_URL reaches a pooler and TELEMACHUS_PGBOUNCER is off (`route`
    None: the pooler refused a connect, `symptom` says how)."""
    found = f" ({symptom})" if symptom else ""
    return (
        f"DATABASE_URL ({where}) reaches PostgreSQL through a connection pooler (PgBouncer or similar){found} but "
        "TELEMACHUS_PGBOUNCER is off, so statements prepared on one server connection would run on another "
        "and about every other request would fail: set TELEMACHUS_PGBOUNCER=1 and "
        f"TELEMACHUS_LISTEN_DATABASE_URL={listen_url_suggested(route=route, user=user, name=name)} "
        "(PostgreSQL itself, for LISTEN)"
    )


def listen_pooled(*, where: str, listen_url_set: bool, route: Route, user: str, name: str) -> str:
    """What to say when LISTEN would go through the pooler (notifications never arrive there)."""
    which = (
        "TELEMACHUS_LISTEN_DATABASE_URL reaches a connection pooler too"
        if listen_url_set
        else "TELEMACHUS_LISTEN_DATABASE_URL is not set"
    )
    return (
        f"TELEMACHUS_PGBOUNCER=1 but {which}: LISTEN would go through the pooler ({where}), where notifications "
        "never arrive (workers would sleep through queued work and cancels): set "
        f"TELEMACHUS_LISTEN_DATABASE_URL={listen_url_suggested(route=route, user=user, name=name)} "
        "(PostgreSQL itself)"
    )


def startup_parameter_refused(exc: psycopg.OperationalError) -> bool:
    """Whether a connect failed because the server refused a startup parameter (the worker's
    `options`): what PgBouncer says of one it does not pass on."""
    return "unsupported startup parameter" in str(exc)


def database_ping() -> bool:
    """One round trip to the database; on PostgreSQL it also says whether this process's
    connection goes through a connection pooler, so a process started before a pooler was put in
    front of PostgreSQL, or served without telemachus/serve.py's start-up check, is not ready
    (/readyz). Never prepared: behind a pooler without TELEMACHUS_PGBOUNCER, the query's own
    prepared statement would be looked for on another server connection. Raises DatabaseError."""
    if connection.vendor != "postgresql":
        Statement("SELECT 1").run()
        return False
    connection.ensure_connection()
    with connection.wrap_database_errors:
        raw = connection.connection
        row = raw.execute(ROUTE_QUERY, prepare=False).fetchone()
        return route_read(protocol_pid=raw.info.backend_pid, row=row).pooled
