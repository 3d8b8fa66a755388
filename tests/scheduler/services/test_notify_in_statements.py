"""Notifications sent from a statement the claim or the finish runs anyway, not from one of their
own: a round trip fewer on every claim and every finish (a worker's, or an API process's one-hop
call's). A finish that frees slots wakes the workers from the statement that frees them; a claim
tells live views from the statement that starts its jobs."""

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from scheduler.models import JobEvent
from scheduler.services.claim import job_claim
from scheduler.services.events import events_riders, job_event
from scheduler.services.finish import Outcome, jobs_finish
from telemachus.control import notify
from telemachus.db.statements import riders_send
from tests.processes import database_url_for_tests

pytestmark = pytest.mark.django_db(transaction=True)


def listening(channel: str) -> psycopg.Connection:
    ears = psycopg.connect(database_url_for_tests().replace("postgres://", "postgresql://"), autocommit=True)
    ears.execute(f"LISTEN {channel}")
    return ears


def test_the_statement_that_frees_the_slots_wakes_the_workers(member_setup, submit):
    if connection.vendor != "postgresql":
        pytest.skip("workers are woken through PostgreSQL's NOTIFY")
    # Given two running jobs, and a connection listening as a worker does...
    alice, _, a, _, _ = member_setup
    submit(alice, a)
    submit(alice, a)
    claims = job_claim(worker="w", limit=2).claims
    assert len(claims) == 2
    with listening(notify.WORKERS_CHANNEL) as ears:
        # When both finish together...
        with CaptureQueriesContext(connection) as finish:
            report = jobs_finish(
                outcomes=[Outcome(job_id=c.job.pk, lease=c.lease, ok=True, result={"n": 1}) for c in claims]
            )
        heard = [n.payload for n in ears.notifies(timeout=2, stop_after=1)]

    # Then the workers hear once that slots were freed, from the DELETE of the slots itself.
    assert sorted(report.accepted) == sorted(c.job.pk for c in claims)
    assert heard == [notify.FREED]
    waking = [q["sql"] for q in finish.captured_queries if f"'{notify.FREED}'" in q["sql"]]
    assert len(waking) == 1 and 'AS (DELETE FROM "scheduler_slot"' in waking[0]


def test_the_statement_that_starts_the_jobs_tells_live_views(member_setup, submit):
    if connection.vendor != "postgresql":
        pytest.skip("live views are told through PostgreSQL's NOTIFY")
    # Given two queued jobs, and a connection listening as a live dashboard does...
    alice, _, a, _, _ = member_setup
    submit(alice, a)
    submit(alice, a)
    with listening(notify.CHANGES_CHANNEL) as ears:
        # When a worker claims both...
        with CaptureQueriesContext(connection) as claim:
            assert len(job_claim(worker="w", limit=2).claims) == 2
        heard = [n.payload for n in ears.notifies(timeout=2, stop_after=1)]

    # Then live views hear once that jobs were claimed, from the UPDATE that started them.
    assert heard == ["claimed"]
    telling = [q["sql"] for q in claim.captured_queries if "'claimed'" in q["sql"]]
    assert len(telling) == 1 and "UPDATE" in telling[0]


def test_job_watchers_hear_from_the_statement_that_records_the_events(member_setup, submit):
    if connection.vendor != "postgresql":
        pytest.skip("API processes watch jobs through PostgreSQL's NOTIFY")
    # Given a queued job, and a connection listening as an API process watching jobs does...
    alice, _, a, _, _ = member_setup
    job = submit(alice, a)
    with listening(notify.JOBS_CHANNEL) as ears:
        # When it is claimed and finished...
        with CaptureQueriesContext(connection) as statements:
            [claim] = job_claim(worker="w").claims
            jobs_finish(outcomes=[Outcome(job_id=job.pk, lease=claim.lease, ok=True, result={"n": 1})])
        heard = [n.payload for n in ears.notifies(timeout=2, stop_after=2)]

    # Then the watchers hear of its start and of its end, each at its commit, and neither claim
    # nor finish ran a statement of its own to tell them: the events' INSERT carried the notice.
    assert heard == [f"{notify.CHANGED}{job.pk}:started", f"{notify.CHANGED}{job.pk}:finished"]
    # (Django logs a statement as its caller wrote it; with parameters bound in the client it logs
    # the SQL sent, wrapped. Either way a notice sent on its own would be a statement here.)
    captured = [q["sql"] for q in statements.captured_queries]
    assert not [sql for sql in captured if sql.upper().startswith("SELECT PG_NOTIFY")], captured
    # The claim's events ride on its slots' INSERT, the finish's are its own INSERT; all written.
    events = list(JobEvent.objects.filter(job=job).order_by("id").values_list("event", flat=True))
    assert events == ["queued", "placed", "started", "finished"]
    if not connection.settings_dict["OPTIONS"].get("server_side_binding"):
        inserts = [sql for sql in captured if 'INSERT INTO "scheduler_jobevent"' in sql]
        assert len(inserts) == 2 and all(sql.startswith("WITH rider0 AS (INSERT") for sql in inserts)
        assert all("notified AS (SELECT pg_notify(" in sql for sql in inserts)
        assert 'main AS (INSERT INTO "scheduler_slot"' in inserts[0]
        assert "main AS (WITH v(" in inserts[1] and 'UPDATE "scheduler_job"' in inserts[1]


def test_a_notice_with_nothing_to_ride_on_is_sent_on_its_own(transactional_db):
    if connection.vendor != "postgresql":
        pytest.skip("API processes watch jobs through PostgreSQL's NOTIFY")
    with listening(notify.JOBS_CHANNEL) as ears:
        # When there is no statement for the notice to ride on...
        riders_send(notify.job_watchers_riders([(7, "started"), (7, "finished")]))
        heard = [n.payload for n in ears.notifies(timeout=2, stop_after=1)]

    # Then it is sent on its own, the last event of the job kept.
    assert heard == [f"{notify.CHANGED}7:finished"]


def test_events_with_nothing_to_ride_on_are_written_and_told(member_setup, submit):
    if connection.vendor != "postgresql":
        pytest.skip("API processes watch jobs through PostgreSQL's NOTIFY")
    alice, _, a, _, _ = member_setup
    job = submit(alice, a)
    with listening(notify.JOBS_CHANNEL) as ears:
        # When events are to ride on a statement that is never sent...
        riders_send(events_riders([job_event(job=job, event=JobEvent.Type.STEP, detail="x")]))
        heard = [n.payload for n in ears.notifies(timeout=2, stop_after=1)]

    # Then they are written and told on their own.
    assert heard == [f"{notify.CHANGED}{job.pk}:step"]
    assert JobEvent.objects.filter(job=job, event=JobEvent.Type.STEP, meta__detail="x").count() == 1


def test_off_postgresql_riding_events_are_written_after_their_statement(member_setup, submit):
    if connection.vendor == "postgresql":
        pytest.skip("statements ride along on PostgreSQL")
    # Given a job and an event to ride on the job's write...
    alice, _, a, _, _ = member_setup
    job = submit(alice, a)
    riders = events_riders([job_event(job=job, event=JobEvent.Type.STEP, detail="y")])
    # Then SQLite, which has no data-modifying CTEs, carries nothing along, and writes the event when asked.
    assert not riders.writes and not riders.notices
    riders_send(riders)
    assert JobEvent.objects.filter(job=job, event=JobEvent.Type.STEP, meta__detail="y").count() == 1
