from django.db import migrations

from telemachus.control.config import watch_config


class Migration(migrations.Migration):
    """Queue policy writes bump the configuration version."""

    dependencies = [
        ("scheduler", "0008_flow_rounds_and_ready_order"),
        ("telemachus", "0004_config_version"),
    ]

    operations = [watch_config("scheduler.QueuePolicy")]
