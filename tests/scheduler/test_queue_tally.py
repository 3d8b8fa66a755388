"""The queue tally's counters hold on both databases, including after migrations that rebuild the
jobs table (SQLite drops a rebuilt table's triggers: scheduler/apps.py puts them back)."""

import pytest
from django.db import connection

from scheduler.core.selectors import queue_depths
from scheduler.models import Job
from scheduler.services.claim import job_claim
from scheduler.services.submit import job_submit

pytestmark = pytest.mark.django_db

TRIGGERS = {
    f"scheduler_queue_tally_{name}" for name in ("team_insert", "team_delete", "job_insert", "job_update", "job_delete")
}


def test_sqlites_triggers_survive_the_migrations_that_rebuild_the_jobs_table():
    if connection.vendor != "sqlite":
        pytest.skip("PostgreSQL's triggers are not dropped by ALTER TABLE")
    with connection.cursor() as cursor:
        cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        present = {name for (name,) in cursor.fetchall()}
    assert TRIGGERS <= present


def test_the_depth_follows_submits_claims_and_ends(member_setup):
    alice, _, team_a, _, _ = member_setup
    jobs = [
        job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        for _ in range(3)
    ]
    assert queue_depths(team_ids=[team_a.pk]) == {team_a.pk: 3}
    job_claim(worker="w", limit=1)
    assert queue_depths(team_ids=[team_a.pk]) == {team_a.pk: 2}
    Job.objects.filter(pk=jobs[-1].pk).delete()
    assert queue_depths(team_ids=[team_a.pk]) == {team_a.pk: 1}
