"""How many rows tables hold, cheaply enough for a dashboard that refreshes every few seconds:
PostgreSQL's own estimate (pg_class.reltuples, kept by ANALYZE and autovacuum: no scan of a
table of millions); SQLite, a count (an embedded deployment's tables are small)."""

from collections.abc import Sequence

from django.db import connection
from django.db.models import Model

from telemachus.db.statements import Statement


def rows_estimate(models: Sequence[type[Model]]) -> dict[type[Model], int]:
    """About how many rows each model's table holds (never below 0: a table never analyzed yet
    counts as empty on PostgreSQL)."""
    if connection.vendor != "postgresql":
        return {model: model._default_manager.count() for model in models}
    tables = {model._meta.db_table: model for model in models}
    found = Statement(
        "SELECT relname, reltuples::bigint FROM pg_class WHERE relkind IN ('r', 'p') AND relname = ANY(%s)",
        [list(tables)],
    ).rows()
    estimates = {tables[name]: max(int(n), 0) for name, n in found}
    return {model: estimates.get(model, 0) for model in models}
