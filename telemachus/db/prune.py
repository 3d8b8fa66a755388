"""Deleting old rows in small batches, without waiting on anyone: retention's one write
(scheduler/services/retention.py, docs/retention.md).

A batch is a few thousand rows picked oldest first through an index, locked with SKIP LOCKED (a
row another transaction holds, a job being requeued say, is left for the next batch instead of
waited on), and deleted with the rows of the tables that hang off them by primary key, in one
statement on PostgreSQL: `WITH doomed(pk) AS (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED), c0 AS
(DELETE FROM child WHERE parent IN (SELECT pk FROM doomed)) DELETE FROM parent WHERE pk IN
(SELECT pk FROM doomed) RETURNING ...`. The picking query is the ORM's (a queryset the caller
builds), so its conditions are never written twice."""

from collections.abc import Sequence
from typing import Any, TypeVar

from django.db import connection
from django.db.models import Model, QuerySet

from telemachus.db.bulk import _field, returned
from telemachus.db.locks import Level, rows_lock
from telemachus.db.statements import Statement

M = TypeVar("M", bound=Model)


def rows_prune(
    rows: "QuerySet[M]",
    *,
    order: Sequence[str],
    limit: int,
    level: Level,
    children: Sequence[tuple[type[Model], str]] = (),
    returning: Sequence[str] = ("pk",),
) -> list[tuple[Any, ...]]:
    """Delete the first `limit` rows of `rows` in `order`, with the rows of each of `children`
    (a model, and its field that names the parent's key) that belong to them; return `returning`
    (fields) of each row deleted, converted as the ORM converts them.

    PostgreSQL: one statement; the rows are locked FOR UPDATE SKIP LOCKED at `level` of the lock
    order (telemachus/db/locks.py), so a batch never waits on a transaction that holds one of
    them, and two pruners take disjoint batches. SQLite (writers serialized): the keys read, then
    one DELETE per table. Must run inside a transaction (the caller's, one per batch, so the
    locks are held for one batch only)."""
    model = rows.model
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    key = qn(str(model._meta.pk.column))
    names = [model._meta.pk.name if name == "pk" else name for name in returning]
    back = ", ".join(qn(str(_field(model, name).column)) for name in names)
    picked = rows.order_by(*order).values_list("pk")[:limit]
    if connection.vendor == "postgresql":
        inner, params = rows_lock(picked, level=level, skip_locked=True, of=("self",)).query.sql_with_params()
        riders = "".join(
            f", c{i} AS (DELETE FROM {qn(child._meta.db_table)} WHERE {qn(str(_field(child, field).column))} "
            f"IN (SELECT pk FROM doomed))"
            for i, (child, field) in enumerate(children)
        )
        sql = (
            f"WITH doomed(pk) AS ({inner}){riders} "
            f"DELETE FROM {table} WHERE {key} IN (SELECT pk FROM doomed) RETURNING {back}"
        )
        return returned(model, names, Statement(sql, list(params)).rows())
    keys = [pk for (pk,) in picked]
    if not keys:
        return []
    marks = ", ".join(["%s"] * len(keys))
    for child, field in children:
        column = qn(str(_field(child, field).column))
        Statement(f"DELETE FROM {qn(child._meta.db_table)} WHERE {column} IN ({marks})", keys).run()
    found = Statement(f"DELETE FROM {table} WHERE {key} IN ({marks}) RETURNING {back}", keys).rows()
    return returned(model, names, found)
