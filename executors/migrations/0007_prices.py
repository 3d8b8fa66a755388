from django.db import migrations, models

from telemachus.control.config import watch_config


class Migration(migrations.Migration):
    """A price per model on each executor. Prices are configuration (the finish and the claim read
    them from the configuration cache), so the executor table is watched again with the new column
    (SQLite also rebuilds the table to add it, losing its triggers)."""

    dependencies = [
        ("executors", "0005_config_version_triggers"),
    ]

    operations = [
        migrations.AddField(
            model_name="executor",
            name="prices",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text='{"<model>": {"input": "<per 1M tokens>", "output": "<per 1M tokens>"}}',
            ),
        ),
        watch_config(
            "executors.Executor",
            ignore=("last_seen", "last_probed_at", "consecutive_failures", "updated_at"),
            replace=True,
        ),
    ]
