from django.db import migrations, models

# The queue tally on SQLite too, so every reader of a team's queue depth reads it one way
# (scheduler/core/selectors.py `queue_depths`) and the submit's guard is the same SQL on both
# databases (scheduler/core/statements.py). PostgreSQL has had it since 0015, where its triggers
# defer their writes to commit so that claims never wait on submits; SQLite serializes writers
# for the whole database, so its row triggers write at once. An unmanaged model lets the ORM read it.

TABLE = """
CREATE TABLE scheduler_queue_tally (
    team_id bigint NOT NULL,
    side text NOT NULL CHECK (side IN ('in', 'out')),
    n bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (team_id, side)
);
INSERT INTO scheduler_queue_tally (team_id, side, n)
SELECT t.id, s.side, CASE WHEN s.side = 'in' THEN
    (SELECT count(*) FROM scheduler_job j WHERE j.team_id = t.id AND j.status = 'queued') ELSE 0 END
FROM telemachus_team t CROSS JOIN (SELECT 'in' AS side UNION ALL SELECT 'out') AS s;
"""

# A status change that moves a job into or out of the queue (or a queued job to another team).
MOVED = "(OLD.status = 'queued') <> (NEW.status = 'queued') OR (OLD.status = 'queued' AND OLD.team_id <> NEW.team_id)"

# IF NOT EXISTS: `triggers_ensure` runs them again after every migrate (below).
TRIGGERS = [
    """CREATE TRIGGER IF NOT EXISTS scheduler_queue_tally_team_insert AFTER INSERT ON telemachus_team BEGIN
        INSERT OR REPLACE INTO scheduler_queue_tally (team_id, side, n) VALUES (NEW.id, 'in', 0), (NEW.id, 'out', 0);
    END""",
    """CREATE TRIGGER IF NOT EXISTS scheduler_queue_tally_team_delete AFTER DELETE ON telemachus_team BEGIN
        DELETE FROM scheduler_queue_tally WHERE team_id = OLD.id;
    END""",
    """CREATE TRIGGER IF NOT EXISTS scheduler_queue_tally_job_insert AFTER INSERT ON scheduler_job
    WHEN NEW.status = 'queued' BEGIN
        UPDATE scheduler_queue_tally SET n = n + 1 WHERE team_id = NEW.team_id AND side = 'in';
    END""",
    f"""CREATE TRIGGER IF NOT EXISTS scheduler_queue_tally_job_update AFTER UPDATE OF status, team_id ON scheduler_job
    WHEN {MOVED} BEGIN
        UPDATE scheduler_queue_tally SET n = n + 1
            WHERE OLD.status = 'queued' AND team_id = OLD.team_id AND side = 'out';
        UPDATE scheduler_queue_tally SET n = n + 1
            WHERE NEW.status = 'queued' AND team_id = NEW.team_id AND side = 'in';
    END""",
    """CREATE TRIGGER IF NOT EXISTS scheduler_queue_tally_job_delete AFTER DELETE ON scheduler_job
    WHEN OLD.status = 'queued' BEGIN
        UPDATE scheduler_queue_tally SET n = n + 1 WHERE team_id = OLD.team_id AND side = 'out';
    END""",
]

DROP = [
    *(
        f"DROP TRIGGER IF EXISTS scheduler_queue_tally_{name}"
        for name in ("team_insert", "team_delete", "job_insert", "job_update", "job_delete")
    ),
    "DROP TABLE IF EXISTS scheduler_queue_tally",
]


def triggers_ensure(connection) -> None:
    """SQLite: the tally's triggers, created again where missing. SQLite rebuilds a table to add
    a NOT NULL column or alter one (Django's `_remake_table`), which drops the table's triggers:
    every later migration that touches scheduler_job would lose them. A post_migrate hook
    (scheduler/apps.py) runs this after each migrate; no job moves during a migration, so the
    counters are still right."""
    if connection.vendor == "sqlite" and "scheduler_queue_tally" in connection.introspection.table_names():
        with connection.cursor() as cursor:
            for statement in TRIGGERS:
                cursor.execute(statement)


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for statement in [*TABLE.split(";"), *TRIGGERS]:
            if statement.strip():
                schema_editor.execute(statement)


def uninstall(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for statement in DROP:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    """The queue tally on SQLite, and the unmanaged model both databases read it through."""

    dependencies = [("scheduler", "0017_constraint_free_slots_and_event_jobs")]

    operations = [
        migrations.RunPython(install, uninstall),
        migrations.CreateModel(
            name="QueueTally",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "team_id", "side", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("team_id", models.BigIntegerField()),
                ("side", models.CharField(max_length=3)),
                ("n", models.BigIntegerField()),
            ],
            options={"db_table": "scheduler_queue_tally", "managed": False},
        ),
    ]
