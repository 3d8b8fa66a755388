from django.db import migrations


def create_policy(apps, schema_editor):
    QueuePolicy = apps.get_model("scheduler", "QueuePolicy")
    QueuePolicy.objects.get_or_create(pk=1)


class Migration(migrations.Migration):
    dependencies = [("scheduler", "0002_initial")]

    operations = [migrations.RunPython(create_policy, migrations.RunPython.noop)]
