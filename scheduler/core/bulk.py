"""Per-row updates of many rows in one statement, for the worker's hot path (finishing a batch).

Django's bulk_update builds a CASE WHEN per row per field, which costs more Python time than
the whole rest of a finish. This writes `WITH v(...) AS (VALUES ...) UPDATE ... FROM v`, which
PostgreSQL and SQLite (3.33+) both run, with values adapted by each field as the ORM would."""

from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.db.models import Model


def update_rows(model: type[Model], rows: Sequence[dict[str, Any]], *, key: str = "id") -> int:
    """Set each row's fields (dict keys, field names) where `key` matches; returns rows updated."""
    if not rows:
        return 0
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
    )
    params = [field.get_db_prep_save(row[field.name], connection) for row in rows for field in fields]  # type: ignore[union-attr]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount
