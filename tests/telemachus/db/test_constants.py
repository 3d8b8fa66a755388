"""telemachus/db/constants.py: constants in a statement's text, so partial indexes serve its one plan."""

import itertools
import re

import psycopg.sql
import pytest
from django.db import connection, transaction

from scheduler.core.locks import _clock
from scheduler.models import Job
from telemachus.db.constants import Constant

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("value", ["it's", "a b", "x'; DROP TABLE scheduler_job; --", "é"])
def test_a_value_that_could_leave_the_literal_is_refused(value):
    with pytest.raises(ValueError, match="not a constant fit for a statement's text"):
        Constant(value)


def test_the_constant_is_written_into_the_text_and_sent_as_no_parameter():
    queued = Job.objects.filter(status=Constant(Job.Status.QUEUED)).exclude(route=Constant(""))
    sql, params = queued.query.sql_with_params()

    assert "'queued'" in sql and "''" in sql
    assert params == ()


def test_a_filter_on_a_constant_finds_what_a_filter_on_the_value_finds(make_user, make_team):
    # Given a queued job and a finished one, so the filter has something to find and to leave out...
    alice = make_user()
    team = make_team(members={alice: "member"})
    for status in (Job.Status.QUEUED, Job.Status.DONE):
        Job.objects.create(type="chat", user=alice, team=team, status=status, model="m", requirements={"model": "m"})
    assert Job.objects.filter(status=Constant(Job.Status.QUEUED)).count() == 1
    assert list(Job.objects.filter(status=Constant(Job.Status.QUEUED))) == list(Job.objects.filter(status="queued"))


@pytest.mark.postgres
def test_the_claims_clock_has_a_generic_plan_that_reads_the_partial_indexes():
    """A prepared statement keeps its generic plan only when that plan is as good as a custom
    one: the clock's reads must be able to use their partial indexes with no values in hand."""
    sql, params = _clock(unflushed=False).query.sql_with_params()
    numbers = itertools.count(1)
    numbered = re.sub(r"%s", lambda _: f"${next(numbers)}", sql)
    with transaction.atomic(), connection.cursor() as cursor:
        raw = connection.connection
        literals = ", ".join(psycopg.sql.Literal(p).as_string(raw) for p in params)
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"PREPARE clock_probe AS {numbered}")
        cursor.execute(f"EXPLAIN EXECUTE clock_probe({literals})")
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("DEALLOCATE clock_probe")

    for index in ("job_retry_idx", "job_tool_queue_idx", "job_queue_deadline_idx", "job_routed_idx"):
        assert index in plan, plan
