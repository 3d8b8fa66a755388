"""Statements sent to PostgreSQL together: one round trip for several.

Each statement waits for its answer before the next is sent. On the claim and the finish of every
call those waits are most of their time in the database: in one 1-client gateway run, the claim's statements
took 2.9 ms (median) from the claiming thread against under 1 ms of executing them (auto_explain),
the rest being a round trip each (the thread and the server taking turns on the cores). Where
statements do not need each other's results, PostgreSQL's pipeline mode sends them in one flight:
the server still runs them one after the other, in order, in the same transaction. (psycopg sends
a transaction's BEGIN first, on its own, even in a pipeline.)

Elsewhere (SQLite, which has no round trips) the statements simply run as they come."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.transaction import TransactionManagementError

from telemachus.db.internals import atomic_in_test_case, atomic_outermost_durable, rollback_pending


@contextmanager
def together() -> Iterator[None]:
    """Send the statements executed in the block in one round trip, when the block ends: read each
    cursor's rows after the block (a fetch inside it costs a round trip of its own). Use a cursor
    per statement: a cursor keeps only its latest result. An error is raised when the block ends,
    as Django's errors, like any statement's."""
    if connection.vendor != "postgresql":
        yield
        return
    connection.ensure_connection()
    with connection.wrap_database_errors, connection.connection.pipeline():
        yield


T = TypeVar("T")


def sent(
    sql: str, params: Sequence[Any], rows: Callable[[list[Any]], T], *, using: str = DEFAULT_DB_ALIAS
) -> Callable[[], T]:
    """Execute a statement now, on a cursor of its own, and return what reads its answer: `rows`
    of the fetched rows, when called. Inside together() the statement goes with the block's
    others, and is read after the block. Elsewhere (SQLite, which has no pipeline) the rows are
    read at once, while they are current."""
    db = connections[using]
    cursor = db.cursor()
    try:
        cursor.execute(sql, params)
        if db.vendor != "postgresql":
            fetched = cursor.fetchall()
            cursor.close()
            return lambda: rows(fetched)
    except BaseException:
        cursor.close()
        raise

    def read() -> T:
        with cursor:
            return rows(cursor.fetchall())

    return read


@contextmanager
def committing() -> Iterator[None]:
    """Send the statements of the block and the COMMIT of the transaction they end in one round
    trip. For the last statements of a durable atomic block (`transaction.atomic(durable=True)`),
    whose rows nothing reads: the COMMIT, which would wait for their answers and then make a round
    trip of its own, goes with them, as one more statement of the pipeline (psycopg's commit()
    would add a round trip: it syncs, and so does the pipeline's end). When the atomic block ends
    it finds the transaction ended (psycopg sends nothing to commit an idle connection) and runs its
    on_commit hooks, as after any commit. An error in the block or at the COMMIT, or a transaction
    marked for rollback, commits nothing: the atomic block rolls back as it would. Inside a test
    case's transaction, which must not end, the statements go together and commit nothing.
    Elsewhere (SQLite) the statements run as they come, and the atomic block commits."""
    if not atomic_outermost_durable(connection):
        raise TransactionManagementError("committing() ends a durable atomic block, inside it")
    with together():
        yield
        if (
            connection.vendor == "postgresql"
            and not rollback_pending(connection)
            and not atomic_in_test_case(connection)
        ):
            connection.connection.execute("COMMIT", prepare=False)
