"""The job and event tables keep few indexes (every one is written at each submit) but never too
few: a foreign key with no index that starts with its column turns each delete of the row it
points at (a user, a team, an executor, a key, a job) into a scan of the table."""

import json
import re

import pytest
from django.db import connection, transaction
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
        key = next(f for f in model._meta.concrete_fields if f.column == column).db_type(connection)
        cursor.execute(
            f"PREPARE fk_check ({key}) AS SELECT 1 FROM ONLY {table} x WHERE {column} = $1 FOR KEY SHARE OF x"
        )
        cursor.execute("EXPLAIN EXECUTE fk_check ('1')")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("DEALLOCATE fk_check")

    # A text key reads `((batch_id)::text = ($1)::text)`, a number `(job_id = $1)`.
    condition = re.search(r"Index Cond: \(\(?(\w+)\)?(::\w+)? = \(?\$1\)?", plan)
    assert "Seq Scan" not in plan and condition is not None and condition[1] == column, plan


# Each table retention prunes (scheduler/services/retention.py), with the index condition its
# batches must be read by: a range of its cut-off column, or each batch (every minute, in every
# worker) reads the table through. Executor events may also be read as the job-less events
# (jobevent_job_idx), which they all are; a planner picks that on a near-empty table.
PRUNED = [
    ("scheduler_job", r"\bfinished_at\b"),
    ("scheduler_jobevent", r"\bat\b|job_id IS NULL|job_id=\?"),
    ("quotas_usage", r"\bwindow_start\b"),
    ("telemachus_auditevent", r"\bat\b"),
    ("telemachus_webhookdelivery", r"\bcreated_at\b"),
    ("scheduler_batch", r"\bended_at\b"),
    ("scheduler_storedfile", r"\bcreated_at\b"),
]


@pytest.fixture
def prune_statements(member_setup):
    """What one pass of retention runs, every kind of batch included (team a removes bodies
    early), on tables that hold nothing to prune."""
    from django.test.utils import CaptureQueriesContext

    from scheduler.services.retention import prune_once
    from telemachus.models import Team

    Team.objects.filter(slug="a").update(body_retention_hours=1)
    with CaptureQueriesContext(connection) as captured:
        prune_once()
    return [q["sql"] for q in captured.captured_queries if q["sql"].startswith(("SELECT", "WITH", "UPDATE", "DELETE"))]


def _postgres_plan_nodes(sql: str) -> list[dict]:
    """Every node of the plan PostgreSQL picks for `sql` when it may not read a table through
    (enable_seqscan off: a sequential scan left in the plan means no index can serve)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN (FORMAT JSON) {sql}")
        (plan,) = cursor.fetchone()
    if isinstance(plan, str):
        plan = json.loads(plan)
    nodes, todo = [], [plan[0]["Plan"]]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(node.get("Plans", []))
    return nodes


def _sqlite_plan(sql: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN QUERY PLAN {sql}")
        return "\n".join(row[-1] for row in cursor.fetchall())


def _picking(statements: list[str], table: str) -> list[str]:
    """The statements that pick a batch of `table`'s rows (PostgreSQL: the batch's CTE; SQLite:
    the read of its keys), not those that delete other tables' rows by it."""
    picks = re.compile(rf'^(WITH doomed\(pk\) AS \()?SELECT [^()]* FROM "{table}" WHERE')
    return [sql for sql in statements if picks.match(sql)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("table, condition", PRUNED)
def test_each_pruned_table_is_read_through_an_index_on_its_cutoff(prune_statements, table, condition):
    """Given one pass of retention: each batch of `table` is read by a range of an index on its
    cut-off (PostgreSQL: an index condition; SQLite: a SEARCH of an index)."""
    picking = _picking(prune_statements, table)
    assert picking
    for sql in picking:
        if connection.vendor == "postgresql":
            # An index scan's condition, or a bitmap heap scan's (its index scans' conditions).
            nodes = [node for node in _postgres_plan_nodes(sql) if node.get("Relation Name") == table]
            found = [node.get("Index Cond") or node.get("Recheck Cond", "") for node in nodes]
        else:
            found = re.findall(rf"SEARCH {table} USING (?:COVERING )?INDEX \w+ \(([^)]*)\)", _sqlite_plan(sql))
        assert any(re.search(condition, cond) for cond in found), (sql, found)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_no_pruning_statement_reads_a_table_through(prune_statements):
    """Given one pass of retention: no statement it runs (picking a batch, deleting its events,
    slots and attempts, removing bodies) needs a sequential scan of any table."""
    scans = [
        (node["Relation Name"], sql[:120])
        for sql in prune_statements
        for node in _postgres_plan_nodes(sql)
        if node["Node Type"] == "Seq Scan"
    ]
    assert scans == []


@pytest.mark.postgres
@pytest.mark.django_db
def test_autovacuum_visits_the_pruned_tables_at_two_percent_dead():
    # Retention deletes their oldest rows all the time; their space is reused once autovacuum
    # has visited (migration 0026). The job table's TOAST table holds the prompts: it counts its
    # dead rows on its own, so it needs the setting too.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, c.reloptions, t.reloptions FROM pg_class c JOIN pg_class t ON t.oid = c.reltoastrelid"
            " WHERE c.relname = ANY(%s) ORDER BY c.relname",
            [[Job._meta.db_table, JobEvent._meta.db_table]],
        )
        found = {name: (table or [], toast or []) for name, table, toast in cursor.fetchall()}

    assert found == {
        "scheduler_job": (["autovacuum_vacuum_scale_factor=0.02"], ["autovacuum_vacuum_scale_factor=0.02"]),
        "scheduler_jobevent": (["autovacuum_vacuum_scale_factor=0.02"], []),
    }
