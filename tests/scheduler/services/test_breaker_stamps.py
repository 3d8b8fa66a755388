"""A dispatch's report to the executor's breaker (executors/health.py `breaker_record`) after its
finish: when the finish saw the breaker closed with no failure counted, all that is left to write
is `last_seen`, stamped at most once a second per executor per process; a fault, a count to reset
and a half-open breaker to close are written at once, every time."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from executors.health import DispatchReport, breaker_quiet, breaker_record
from executors.models import Executor
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, jobs_finish

pytestmark = pytest.mark.django_db(transaction=True)


def run_one(alice, team, submit) -> frozenset[int]:
    """Submit, claim and finish one job; what its finish saw clean."""
    submit(alice, team)
    [claim] = job_claim(worker="w").claims
    return jobs_finish(outcomes=[Outcome(job_id=claim.job.pk, lease=claim.lease, ok=True, result={})]).clean


def test_answers_from_a_clean_executor_stamp_last_seen_once_a_second(member_setup, submit):
    # Given an executor whose breaker is closed with no failure counted...
    alice, _, a, _, shared = member_setup
    answered = [DispatchReport(executor_id=shared.pk, ok=True)]
    # When two calls on it finish within a second...
    clean = run_one(alice, a, submit)
    quiet_first = breaker_quiet(reports=answered, clean=clean)
    with CaptureQueriesContext(connection) as first:
        breaker_record(reports=answered, clean=clean)
    again = run_one(alice, a, submit)
    quiet_second = breaker_quiet(reports=answered, clean=again)
    with CaptureQueriesContext(connection) as second:
        breaker_record(reports=answered, clean=again)

    # Then the first stamps last_seen, the second writes nothing, and breaker_quiet (which callers
    # ask before handing the record to a database thread) says so beforehand.
    assert (quiet_first, quiet_second) == (False, True)
    assert clean == {shared.pk}
    assert len(first.captured_queries) == 1 and "last_seen" in first.captured_queries[0]["sql"]
    assert second.captured_queries == []
    shared.refresh_from_db()
    assert shared.last_seen is not None


def test_an_answer_after_a_failure_resets_the_count_at_once(member_setup, submit):
    # Given a clean executor stamped a moment ago...
    alice, _, a, _, shared = member_setup
    answered = [DispatchReport(executor_id=shared.pk, ok=True)]
    breaker_record(reports=answered, clean=run_one(alice, a, submit))
    # When a fault is reported (by any process), then the next call answers...
    breaker_record(reports=[DispatchReport(executor_id=shared.pk, ok=False, executor_fault=True)])
    shared.refresh_from_db()
    assert shared.consecutive_failures == 1
    clean = run_one(alice, a, submit)
    breaker_record(reports=answered, clean=clean)

    # Then its finish saw the count, and the answer reset it, within the same second.
    assert clean == frozenset()
    assert not breaker_quiet(reports=[DispatchReport(executor_id=shared.pk, ok=False, executor_fault=True)])
    shared.refresh_from_db()
    assert shared.consecutive_failures == 0 and shared.breaker == Executor.Breaker.CLOSED


def test_the_answer_to_a_half_open_breakers_trial_closes_it(member_setup, submit):
    # Given a clean executor stamped a moment ago, whose breaker then opened and went half open...
    alice, _, a, _, shared = member_setup
    answered = [DispatchReport(executor_id=shared.pk, ok=True)]
    breaker_record(reports=answered, clean=run_one(alice, a, submit))
    Executor.objects.filter(pk=shared.pk).update(breaker=Executor.Breaker.HALF_OPEN, consecutive_failures=0)
    # When its trial answers...
    clean = run_one(alice, a, submit)
    events = breaker_record(reports=answered, clean=clean)

    # Then the finish did not see it clean, and the breaker closed.
    assert clean == frozenset()
    assert [e.event for e in events] == ["breaker_closed"]
    shared.refresh_from_db()
    assert shared.breaker == Executor.Breaker.CLOSED
