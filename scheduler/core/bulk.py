"""Many rows in one statement, for the claim's and the finish's hot paths: per-row updates
(`update_rows`) and inserts whose SQL is built once (`insert_statement`, `rows_insert`).

Django's bulk_update builds a CASE WHEN per row per field, which costs more Python time than
the whole rest of a finish. This writes `WITH v(...) AS (VALUES ...) UPDATE ... FROM v`, which
PostgreSQL and SQLite (3.33+; 3.35+ with RETURNING) both run, with values adapted by each field as
the ORM would."""

from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.db.models import Field, Model


def update_rows(
    model: type[Model], rows: Sequence[dict[str, Any]], *, key: str = "id", returning: bool = False
) -> None:
    """Set each row's fields (dict keys, field names) where `key` matches. Reads nothing back, so
    it can go with other statements in one round trip (telemachus/pipeline.py). `returning`: the
    statement returns each updated row's key (a statement other statements can ride on:
    scheduler/services/events.py `events_riding`)."""
    if not rows:
        return
    names = [key, *(name for name in rows[0] if name != key)]
    fields = [model._meta.get_field(name) for name in names]
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    columns = [qn(field.column) for field in fields]  # type: ignore[arg-type, union-attr]
    if connection.vendor == "postgresql":
        placeholder = "(" + ", ".join(f"%s::{field.db_type(connection)}" for field in fields) + ")"
    else:
        placeholder = "(" + ", ".join("%s" for _ in fields) + ")"
    sql = (
        f"WITH v({', '.join(columns)}) AS (VALUES {', '.join([placeholder] * len(rows))}) "
        f"UPDATE {table} SET {', '.join(f'{c} = v.{c}' for c in columns[1:])} "
        f"FROM v WHERE {table}.{columns[0]} = v.{columns[0]}"
    ) + (f" RETURNING {table}.{columns[0]}" if returning else "")
    params = [field.get_db_prep_save(row[field.name], connection) for row in rows for field in fields]  # type: ignore[union-attr]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


# The INSERT statement of each (model, vendor): built once, like a compiled query.
_INSERTS: dict[tuple[type[Model], str], tuple[str, str, list[Field[Any, Any]]]] = {}


def insert_statement(model: type[Model], objs: Sequence[Model], *, returning: bool = False) -> tuple[str, list[Any]]:
    """PostgreSQL: one INSERT of the unsaved `objs` (primary keys left to the database), one array
    per column through UNNEST as Django's bulk_create sends them, with each value prepared by its
    field as the ORM prepares it (pre_save, get_db_prep_save). The SQL is built once per model:
    compiling bulk_create's query each time was about a third of the Python time of the claim's
    slot and event inserts. `returning`: the statement returns the new primary keys, in order."""
    key = (model, connection.vendor)
    built = _INSERTS.get(key)
    if built is None:
        qn = connection.ops.quote_name
        fields = [f for f in model._meta.concrete_fields if not f.primary_key and not f.generated]
        columns = ", ".join(qn(str(f.column)) for f in fields)
        arrays = ", ".join(f"%s::{f.db_type(connection)}[]" for f in fields)
        built = _INSERTS[key] = (
            f"INSERT INTO {qn(model._meta.db_table)} ({columns}) SELECT * FROM UNNEST({arrays})",
            f" RETURNING {qn(str(model._meta.pk.column))}",  # type: ignore[union-attr]
            fields,
        )
    sql, keys, fields = built
    if returning:
        sql += keys
    params = [[f.get_db_prep_save(f.pre_save(obj, True), connection) for obj in objs] for f in fields]
    return sql, params


def rows_insert(model: type[Model], objs: Sequence[Model]) -> None:
    """Insert the unsaved `objs` in one statement and give each its primary key, as bulk_create
    does: `insert_statement` on PostgreSQL, bulk_create elsewhere."""
    if not objs:
        return
    if connection.vendor != "postgresql":
        model._default_manager.bulk_create(objs)
        return
    with connection.cursor() as cursor:
        cursor.execute(*insert_statement(model, objs, returning=True))
        keys = cursor.fetchall()
    for obj, (pk,) in zip(objs, keys, strict=True):
        obj.pk = pk
        obj._state.adding, obj._state.db = False, connection.alias
