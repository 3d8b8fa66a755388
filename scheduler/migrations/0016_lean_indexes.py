from django.conf import settings
from django.db import migrations, models
from django.db.models import deletion

# The single-column indexes Django made for these fields (its names, the same on PostgreSQL and
# SQLite), dropped: each is covered by a composite index that starts with its column, or replaced
# by a partial one below, or (the lease) never read without the job's id.
DROPPED = {
    "scheduler_job": {
        "scheduler_job_team_id_d42d6e4e": "team_id",
        "scheduler_job_user_id_0625df97": "user_id",
        "scheduler_job_executor_id_07cbb180": "executor_id",
        "scheduler_job_key_id_4064d244": "key_id",
        "scheduler_job_parent_flow_id_3b53d899": "parent_flow_id",
        "scheduler_job_avoid_executor_id_97e9020f": "avoid_executor_id",
        "scheduler_job_affinity_executor_id_c30072c2": "affinity_executor_id",
        "scheduler_job_lease_58f4d8e6": "lease",
    },
    "scheduler_jobevent": {
        "scheduler_jobevent_job_id_8a298d37": "job_id",
        "scheduler_jobevent_executor_id_cf14bb1f": "executor_id",
    },
}


def _fk(to: str, related_name: str, *, null: bool = True, on_delete=deletion.SET_NULL) -> models.ForeignKey:
    return models.ForeignKey(
        blank=null, null=null, db_index=False, on_delete=on_delete, related_name=related_name, to=to
    )


class Migration(migrations.Migration):
    """Fewer index entries per submitted job: 14 index writes per job row and 5 per event row
    before, 6 and 2 after (a job submitted with no key, no session, no run_after).

    The fields' indexes are dropped by name rather than by AlterField, which on PostgreSQL drops and
    re-adds (re-validating, a scan of the table each) every foreign key constraint it touches, and
    on SQLite rebuilds the table; the partial indexes are built before the old ones go."""

    dependencies = [
        ("executors", "0007_prices"),
        ("scheduler", "0015_queue_tally"),
        ("telemachus", "0005_api_keys"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                models.F("executor"), condition=models.Q(("executor__isnull", False)), name="job_executor_idx"
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(models.F("key"), condition=models.Q(("key__isnull", False)), name="job_key_idx"),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                models.F("parent_flow"), condition=models.Q(("parent_flow__isnull", False)), name="job_parent_flow_idx"
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                models.F("avoid_executor"),
                condition=models.Q(("avoid_executor__isnull", False)),
                name="job_avoid_executor_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                models.F("affinity_executor"),
                condition=models.Q(("affinity_executor__isnull", False)),
                name="job_affinity_executor_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="jobevent",
            index=models.Index(
                models.F("executor"), condition=models.Q(("executor__isnull", False)), name="jobevent_executor_idx"
            ),
        ),
        migrations.RemoveIndex(model_name="jobevent", name="jobevent_event_idx"),
        migrations.AddIndex(
            model_name="jobevent",
            index=models.Index(
                models.F("event"),
                models.F("at"),
                condition=models.Q(("event", "queued"), _negated=True),
                name="jobevent_event_idx",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    sql=[f"DROP INDEX {name}" for indexes in DROPPED.values() for name in indexes],
                    reverse_sql=[
                        f"CREATE INDEX {name} ON {table} ({column})"
                        for table, indexes in DROPPED.items()
                        for name, column in indexes.items()
                    ],
                )
            ],
            state_operations=[
                migrations.AlterField(
                    "job", "team", _fk("telemachus.team", "jobs", null=False, on_delete=deletion.PROTECT)
                ),
                migrations.AlterField(
                    "job", "user", _fk(settings.AUTH_USER_MODEL, "jobs", null=False, on_delete=deletion.PROTECT)
                ),
                migrations.AlterField("job", "executor", _fk("executors.executor", "jobs")),
                migrations.AlterField("job", "key", _fk("telemachus.apikey", "jobs")),
                migrations.AlterField(
                    "job", "parent_flow", _fk("scheduler.job", "children", on_delete=deletion.CASCADE)
                ),
                migrations.AlterField("job", "avoid_executor", _fk("executors.executor", "+")),
                migrations.AlterField("job", "affinity_executor", _fk("executors.executor", "+")),
                migrations.AlterField("job", "lease", models.UUIDField(blank=True, null=True)),
                migrations.AlterField("jobevent", "job", _fk("scheduler.job", "events", on_delete=deletion.CASCADE)),
                migrations.AlterField("jobevent", "executor", _fk("executors.executor", "events")),
            ],
        ),
    ]
