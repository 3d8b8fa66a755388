# Drops the database constraints of the slots' references and of the events' job (why: the models'
# comments). Only the constraints go: the indexes stay, and on PostgreSQL dropping a constraint
# rewrites nothing (SQLite rebuilds the two tables).

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("executors", "0007_prices"),
        ("scheduler", "0016_lean_indexes"),
        ("telemachus", "0005_api_keys"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AlterField(
            model_name="jobevent",
            name="job",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="events",
                to="scheduler.job",
            ),
        ),
        migrations.AlterField(
            model_name="slot",
            name="executor",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="slots",
                to="executors.executor",
            ),
        ),
        migrations.AlterField(
            model_name="slot",
            name="job",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="slots",
                to="scheduler.job",
            ),
        ),
        migrations.AlterField(
            model_name="slot",
            name="team",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="slots",
                to="telemachus.team",
            ),
        ),
        migrations.AlterField(
            model_name="slot",
            name="user",
            field=models.ForeignKey(
                db_constraint=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="slots",
                to=settings.AUTH_USER_MODEL,
            ),
        ),
    ]
