from django.db import migrations

from telemachus.control.config import watch_config


class Migration(migrations.Migration):
    """Quota rule writes bump the configuration version (the usage ledger is live, not watched)."""

    dependencies = [
        ("quotas", "0002_usage"),
        ("telemachus", "0004_config_version"),
    ]

    operations = [watch_config("quotas.QuotaPolicy")]
