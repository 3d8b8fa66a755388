# Autovacuum visits the job and event tables (and the job table's TOAST table, where prompts and
# answers live) once 2 % of their rows are dead, not PostgreSQL's default 20 %: retention deletes
# a steady stream of their oldest rows, and the space of deleted rows is reused only after a
# visit. At the default an hour's window at 700 jobs/s grew its job table by a quarter before
# the TOAST table's first visit (bench/RESULTS.md; docs/retention.md). PostgreSQL only: SQLite
# has no autovacuum.

from django.db import migrations

# Table -> its storage parameters (ALTER TABLE ... SET), reset on the way back.
SETTINGS = {
    "scheduler_job": ("autovacuum_vacuum_scale_factor", "toast.autovacuum_vacuum_scale_factor"),
    "scheduler_jobevent": ("autovacuum_vacuum_scale_factor",),
}
SCALE_FACTOR = 0.02


def vacuum_sooner(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, names in SETTINGS.items():
        schema_editor.execute(f"ALTER TABLE {table} SET ({', '.join(f'{n} = {SCALE_FACTOR}' for n in names)})")


def vacuum_as_default(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, names in SETTINGS.items():
        schema_editor.execute(f"ALTER TABLE {table} RESET ({', '.join(names)})")


class Migration(migrations.Migration):
    dependencies = [("scheduler", "0025_batch_retention")]

    operations = [migrations.RunPython(vacuum_sooner, vacuum_as_default)]
