from django.db import migrations, models

from telemachus.db.migrations import AddIndexOnline


class Migration(migrations.Migration):
    """Whether a queued job waits for its budget's window (`Job.budget_wait`). The column has a
    database default, so the previous release's submits, which do not name it, keep working while
    it runs; the partial index is built without locking the jobs table (CONCURRENTLY)."""

    atomic = False

    dependencies = [("scheduler", "0018_queue_tally_everywhere")]

    operations = [
        migrations.AddField(
            model_name="job", name="budget_wait", field=models.BooleanField(default=True, db_default=True)
        ),
        AddIndexOnline(
            model_name="job",
            index=models.Index(
                models.F("team"),
                models.F("user"),
                condition=models.Q(("budget_wait", False), ("status", "queued")),
                name="job_no_budget_wait_idx",
            ),
        ),
    ]
