from django.db import migrations

from telemachus.control.config import watch_config


class Migration(migrations.Migration):
    """Executor edits bump the configuration version, and so do breaker and health transitions
    (placement reads them); the runtime bookkeeping the breaker and probes write on every dispatch
    and probe does not."""

    dependencies = [
        ("executors", "0004_alter_executor_options"),
        ("telemachus", "0004_config_version"),
    ]

    operations = [
        watch_config(
            "executors.Executor", ignore=("last_seen", "last_probed_at", "consecutive_failures", "updated_at")
        ),
    ]
