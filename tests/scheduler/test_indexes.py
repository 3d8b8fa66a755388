"""The job and event tables keep few indexes (every one is written at each submit) but never too
few: a foreign key with no index that starts with its column turns each delete of the row it
points at (a user, a team, an executor, a key, a job) into a scan of the table."""

import pytest
from django.db import connection
from django.db.models import ForeignKey

from scheduler.models import Job, JobEvent

TABLES = [Job, JobEvent]


def _leading_columns(table: str) -> set[str]:
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
    return {c["columns"][0] for c in constraints.values() if c["index"] and c["columns"]}


@pytest.mark.django_db
@pytest.mark.parametrize("model", TABLES, ids=lambda m: m.__name__)
def test_every_foreign_key_leads_an_index(model):
    leading = _leading_columns(model._meta.db_table)

    missing = [f.column for f in model._meta.concrete_fields if isinstance(f, ForeignKey) and f.column not in leading]

    assert missing == []


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize(
    "model, column",
    [(m, f.column) for m in TABLES for f in m._meta.concrete_fields if isinstance(f, ForeignKey)],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_foreign_key_checks_use_an_index(model, column):
    """What PostgreSQL runs when the row a key points at is deleted, with the plan it caches (a
    generic one: the value is a parameter), finds its rows through an index, partial or not."""
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        table = model._meta.db_table
        cursor.execute(
            f"PREPARE fk_check (bigint) AS SELECT 1 FROM ONLY {table} x WHERE {column} = $1 FOR KEY SHARE OF x"
        )
        cursor.execute("EXPLAIN EXECUTE fk_check (1)")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("DEALLOCATE fk_check")

    assert "Seq Scan" not in plan and "Index Cond: (" + column + " = $1)" in plan, plan
