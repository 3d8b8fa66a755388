"""Reads that must agree with each other: one snapshot of the database for several queries."""

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction

from telemachus.db.statements import Statement


@contextmanager
def consistent_read() -> Iterator[None]:
    """Run the reads inside as one snapshot of the database: a read-only REPEATABLE READ
    transaction on PostgreSQL; on SQLite a deferred (read) transaction, which in WAL mode sees one
    snapshot from its first read on and never takes the write lock (Django's own transactions
    begin IMMEDIATE, which would). Inside a transaction already, the caller's one is used."""
    if connection.in_atomic_block:
        yield
        return
    if connection.vendor == "postgresql":
        with transaction.atomic():
            Statement("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY").run()
            yield
        return
    connection.ensure_connection()
    Statement("BEGIN DEFERRED").run()
    try:
        yield
    finally:
        Statement("COMMIT").run()
