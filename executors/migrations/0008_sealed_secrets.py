from django.db import migrations

from executors.credentials import plain_secrets_moved


def plain_secrets_sealed(apps, schema_editor):
    """Every secret an executor row holds in clear (a user and password in its endpoint, an API key
    or headers in its transport, a secret-named entry of its transport or meta) is moved to where
    credentials go now and sealed (executors/credentials.py, `plain_secrets_moved`): nothing is lost,
    and what the driver sent it still sends. Rows are written one by one, only when something moved;
    a row whose transport or meta is not an object (written by SQL; read as empty) is left as it is."""
    Executor = apps.get_model("executors", "Executor")
    for executor in Executor.objects.order_by("pk").iterator():
        if not (isinstance(executor.transport, dict) and isinstance(executor.meta, dict)):
            continue
        moved = plain_secrets_moved(endpoint=executor.endpoint, transport=executor.transport, meta=executor.meta)
        if moved != (executor.endpoint, executor.transport, executor.meta):
            executor.endpoint, executor.transport, executor.meta = moved
            executor.save(update_fields=["endpoint", "transport", "meta"])


class Migration(migrations.Migration):
    """Executors' secrets sealed at rest, never stored in clear (#41)."""

    dependencies = [
        ("executors", "0007_prices"),
    ]

    operations = [
        migrations.RunPython(plain_secrets_sealed, migrations.RunPython.noop),
    ]
