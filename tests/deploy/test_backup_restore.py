"""The backup procedure of docs/deploy.md ("Backups and restore"), under load: `pg_dump
--format=custom` of the live database while jobs are submitted and two worker processes run them,
some running at the moment of the dump; `pg_restore` into a new database; workers started on the
restored one. Every job the dump holds finishes there, none lost and none finished twice: those
that were queued are claimed, those that were running (their workers are not there to finish them)
come back by their expired leases (scheduler/services/recover.py), requeued and run again."""

import subprocess
import threading
import time

import pytest
from django.db import connection

from scheduler.models import Job
from scheduler.services.submit import job_submit
from tests.deploy.databases import database_url, scratch_database, server_args, server_connect
from tests.deploy.tools import tool
from tests.processes import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LEASE_SECONDS = 2
# Jobs submitted at most: the flow outlasts the dump, and the restore's work stays a few seconds.
MOST_JOBS = 80


@pytest.fixture
def restored_name():
    """A database of this run's own for the restore, dropped afterwards."""
    with scratch_database("restored") as name:
        yield name


def test_a_dump_taken_under_load_restores_and_every_job_in_it_finishes_once(
    processes, make_user, make_team, make_executor, tmp_path, restored_name
):
    pg_dump, pg_restore = tool("pg_dump", package="postgresql-client"), tool("pg_restore", package="postgresql-client")
    # Given two workers running half-second jobs on 8 slots while jobs keep coming, faster than that
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    make_executor("sim", models=["m"], max_concurrency=8, meta={"latency_ms": 500})
    for name in ("w1", "w2"):
        processes.worker(name, concurrency=4, lease=LEASE_SECONDS)
    flowing = threading.Event()
    flowing.set()

    def submit() -> None:
        try:
            for _ in range(MOST_JOBS):
                if not flowing.is_set():
                    return
                job_submit(
                    user=alice,
                    team="a",
                    type="chat",
                    requirements={"model": "m", "est_tokens": 10},
                    input={"messages": [{"role": "user", "content": "hi"}]},
                )
                time.sleep(0.03)
        finally:
            connection.close()

    submitter = threading.Thread(target=submit)
    submitter.start()
    try:
        wait_until(
            lambda: (
                Job.objects.filter(status="done").count() >= 4
                and Job.objects.filter(status="running").count() >= 4
                and Job.objects.filter(status="queued").exists()
            ),
            timeout=60,
            what="jobs done, running and queued at once",
        )

        # When the database is dumped as the procedure says, while the jobs flow
        dump = tmp_path / "telemachus.dump"
        subprocess.run(
            [pg_dump, *server_args(), "--format=custom", "--file", str(dump), connection.settings_dict["NAME"]],
            check=True,
            capture_output=True,
        )
        time.sleep(0.3)  # the flow goes on past the dump (what the restore will not have)
    finally:
        flowing.clear()
        submitter.join(timeout=30)
    processes.stop_all()  # the original deployment is gone

    # And restored into a new database
    subprocess.run(
        [pg_restore, *server_args(), "--no-owner", "--exit-on-error", "--dbname", restored_name, str(dump)],
        check=True,
        capture_output=True,
    )
    with server_connect(restored_name) as restored:
        at_dump = dict(restored.execute("SELECT id, status FROM scheduler_job").fetchall())
        slots_at_dump = restored.execute("SELECT count(*) FROM scheduler_slot").fetchone()[0]
    running_at_dump = {job for job, status in at_dump.items() if status == "running"}
    queued_at_dump = {job for job, status in at_dump.items() if status == "queued"}
    # The dump caught jobs mid-run (their slots and leases with them) and jobs waiting
    assert running_at_dump and queued_at_dump, at_dump
    assert slots_at_dump == len(running_at_dump)

    # And workers start on the restored database
    for name in ("r1", "r2"):
        processes.worker(name, concurrency=4, lease=LEASE_SECONDS, DATABASE_URL=database_url(restored_name))

    # Then every job the dump holds finishes: none lost
    with server_connect(restored_name) as restored:

        def all_done() -> bool:
            statuses = dict(restored.execute("SELECT id, status FROM scheduler_job").fetchall())
            return set(statuses) == set(at_dump) and set(statuses.values()) == {"done"}

        wait_until(all_done, timeout=90, interval=0.2, what="every restored job to finish")
        finished = dict(
            restored.execute(
                "SELECT job_id, count(*) FROM scheduler_jobevent WHERE event = 'finished' GROUP BY job_id"
            ).fetchall()
        )
        recovered = {
            job
            for (job,) in restored.execute(
                "SELECT job_id FROM scheduler_jobevent WHERE event = 'requeued' AND meta->>'reason' = 'lease expired'"
            ).fetchall()
        }
        slots_left = restored.execute("SELECT count(*) FROM scheduler_slot").fetchone()[0]

    # None finished twice
    assert finished == dict.fromkeys(at_dump, 1)
    # The jobs that were running came back by their leases, and only those
    assert recovered == running_at_dump
    assert slots_left == 0
