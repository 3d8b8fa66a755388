"""Statements as values, and statements that ride on another one.

A write on the hot path often has companions that need nothing from it but its transaction: the
events that record the change, the NOTIFY that tells the processes watching the jobs. Each would
be a round trip of its own. On PostgreSQL they ride on the main statement instead, as CTEs of
it: `WITH rider0 AS (<insert>), notified AS (SELECT pg_notify(...)), main AS (<statement>)
SELECT main.* FROM main, notified`. PostgreSQL runs every data-modifying CTE once, to completion,
whatever the outer query reads; a plain SELECT CTE (the NOTIFY) runs only when read, hence the
cross join, which also means the main statement must return a row for each row it writes (an
INSERT or UPDATE with RETURNING) and at least one: the builders here say so where they compose.

The composition is explicit: the caller hands the riders to the statement that carries them
(`ridden`), nothing rewrites "the next statement" behind its back. Elsewhere (SQLite, which has no
data-modifying CTEs and no round trips to save) the main statement runs alone and the riders'
`instead` runs after it."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from telemachus.db.internals import wrapped_cursor
from telemachus.db.pipeline import sent

T = TypeVar("T")


@dataclass(frozen=True)
class Statement:
    """One SQL statement and its parameters (%s placeholders, as Django's cursors take them)."""

    sql: str
    params: Sequence[Any] = ()

    def run(self) -> None:
        """Execute it on the default connection, reading nothing."""
        with connection.cursor() as cursor:
            cursor.execute(self.sql, self.params)

    def rows(self, *, prepared: bool = False) -> list[Any]:
        """Execute it and read every row. `prepared` (PostgreSQL): parameters bound on the server
        and the statement prepared on its first use on a connection, so a long statement on a hot
        path (the submit's) is planned once per connection, not at every call: a quarter of a
        millisecond for the submit's. Never behind PgBouncer in transaction pooling
        (TELEMACHUS_PGBOUNCER), which would run it on a server connection that never saw it
        prepared."""
        if prepared and connection.vendor == "postgresql":
            return _prepared_rows(self)
        with connection.cursor() as cursor:
            cursor.execute(self.sql, self.params)
            rows: list[Any] = cursor.fetchall()
            return rows


class _PreparedCursor(psycopg.Cursor[Any]):
    """A psycopg cursor that prepares what it executes (unless behind a transaction pooler)."""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Any:
        prepare = not settings.TELEMACHUS_PGBOUNCER if prepare is None else prepare
        return super().execute(query, params, prepare=prepare, binary=binary)


def default_connection() -> BaseDatabaseWrapper:
    """The default connection itself, not `django.db.connection`, a proxy that looks the
    connection up in a context-local at every attribute read: on a hot path (a field's preparation
    reads it a few times per value) about a tenth of a one-by-one submit's Python time."""
    return connections[DEFAULT_DB_ALIAS]


def _prepared_rows(statement: Statement) -> list[Any]:
    real = default_connection()
    real.ensure_connection()
    with wrapped_cursor(DEFAULT_DB_ALIAS, _PreparedCursor(real.connection)) as cursor:
        cursor.execute(statement.sql, statement.params)
        rows: list[Any] = cursor.fetchall()
        return rows


@dataclass(frozen=True)
class Riders:
    """What rides on a statement: `writes` (data-modifying statements that return nothing) and
    `notices` (SELECTs of pg_notify), both PostgreSQL; `instead`, what to run after the statement
    where nothing can ride (SQLite): the same writes made there, say."""

    writes: Sequence[Statement] = ()
    notices: Sequence[Statement] = ()
    instead: Callable[[], None] | None = field(default=None, compare=False)

    def __bool__(self) -> bool:
        return bool(self.writes or self.notices or self.instead)


NO_RIDERS = Riders()


def ridden(main: Statement, riders: Riders) -> Statement:
    """`main` with the riders' writes and notices as CTEs of it (PostgreSQL): it returns what
    `main` returns. `main` must return a row for each row it writes, and write at least one, or
    the notices would not be sent (the writes are, either way)."""
    if not (riders.writes or riders.notices):
        return main
    ctes: list[str] = []
    params: list[Any] = []
    for i, rider in enumerate(riders.writes):
        ctes.append(f"rider{i} AS ({rider.sql})")
        params += rider.params
    if riders.notices:
        sends = ", ".join(notice.sql.removeprefix("SELECT ") for notice in riders.notices)
        ctes.append(f"notified AS (SELECT {sends})")
        for notice in riders.notices:
            params += notice.params
    told = ", notified" if riders.notices else ""
    return Statement(
        f"WITH {', '.join(ctes)}, main AS ({main.sql}) SELECT main.* FROM main{told}", [*params, *main.params]
    )


def riding_supported() -> bool:
    """Whether statements can ride on another here (PostgreSQL's data-modifying CTEs)."""
    return connection.vendor == "postgresql"


def send(main: Statement, riders: Riders = NO_RIDERS) -> None:
    """Execute `main` with its riders, reading nothing: as one statement on PostgreSQL (inside
    telemachus.db.pipeline.together() it goes with the block's others); elsewhere `main`, then
    `riders.instead`."""
    if riding_supported():
        ridden(main, riders).run()
        return
    main.run()
    if riders.instead is not None:
        riders.instead()


def riders_send(riders: Riders) -> None:
    """Send riders with nothing to ride on: each write and notice as a statement of its own on
    PostgreSQL; elsewhere `riders.instead`."""
    if riding_supported():
        for statement in [*riders.writes, *riders.notices]:
            statement.run()
    elif riders.instead is not None:
        riders.instead()


def sent_rows(main: Statement, riders: Riders, rows: Callable[[list[Any]], T]) -> Callable[[], T]:
    """Execute `main` with its riders now and return what reads its rows (`rows` of them) when
    called (telemachus.db.pipeline.sent): inside together() the statement goes with the block's
    others, and is read after the block."""
    if riding_supported():
        statement = ridden(main, riders)
        return sent(statement.sql, statement.params, rows)
    read = sent(main.sql, main.params, rows)
    if riders.instead is not None:
        riders.instead()
    return read
