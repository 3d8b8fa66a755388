from django.db import migrations, models

from telemachus.db.migrations import AddIndexOnline


class Migration(migrations.Migration):
    """Retention deletes webhook deliveries by their age (created_at, oldest first): without an
    index each batch walked the table. Built without locking the deliveries table (CONCURRENTLY
    on PostgreSQL), which the delivery loop writes all the time."""

    atomic = False

    dependencies = [("telemachus", "0008_retention")]

    operations = [
        AddIndexOnline(
            model_name="webhookdelivery",
            index=models.Index(
                models.F("created_at"), condition=~models.Q(status="pending"), name="webhookdelivery_created_idx"
            ),
        ),
    ]
