"""What one model call costs the database on PostgreSQL, past its submit (test_submit.py pins that):
its claim, its finish and its breaker report, as an API process makes them for a one-hop call and
a worker for a job (issue #22). The notices to watchers ride on the events' INSERT, the claim's
commit does not wait for the flush, and an answer from an executor the finish saw clean writes
nothing more within the second."""

import pytest

from executors.health import DispatchReport, breaker_record
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, jobs_finish
from tests.roundtrips import round_trips

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# Claim: BEGIN; the claim lock; the clock, configuration version and synchronous_commit; slot counts;
# the queue's heads; the slot counts again (read after the heads: ClaimState.recount); team shares;
# the job marked running; its slot with its events (and their notice); fair share's entry charge;
# COMMIT.
CLAIM = 11
# ...in 6 round trips: the lock, the clock and the slot counts go together, so do the heads, the
# counts again and the shares, and so do the charge and the COMMIT (telemachus/db/pipeline.py).
CLAIM_ROUND_TRIPS = 6
# Finish: BEGIN; the job locked (with its executor's failures); its end with its event (and the
# event's notice); its slot freed (waking the workers); fair share; COMMIT. (A call that costs
# something adds its spend row; this executor is free.)
FINISH = 6
# ...in 4 round trips: the end and the slot's DELETE go together, and so do fair share and the
# COMMIT (telemachus/db/pipeline.py).
FINISH_ROUND_TRIPS = 4


def call(alice, team, submit, django_assert_num_queries) -> None:
    submit(alice, team)
    claims = []
    with django_assert_num_queries(CLAIM):
        assert round_trips(lambda: claims.extend(job_claim(worker="w").claims)) == CLAIM_ROUND_TRIPS
    [claim] = claims
    assert claim.executor is not None
    reports = []
    outcome = Outcome(job_id=claim.job.pk, lease=claim.lease, ok=True, result={})
    with django_assert_num_queries(FINISH):
        assert round_trips(lambda: reports.append(jobs_finish(outcomes=[outcome]))) == FINISH_ROUND_TRIPS
    [report] = reports
    assert report.accepted == [claim.job.pk]
    with django_assert_num_queries(0):
        breaker_record(reports=[DispatchReport(executor_id=claim.executor.pk, ok=True)], clean=report.clean)


def test_a_calls_claim_finish_and_breaker_report(member_setup, submit, django_assert_num_queries):
    # Given the configuration read, the executor's last_seen stamped and the statements prepared
    # on the server by earlier calls (psycopg prepares a statement at its 5th execution, which
    # costs that execution a round trip more)...
    alice, _, a, _, shared = member_setup
    for _ in range(6):
        submit(alice, a)
        [claim] = job_claim(worker="w").claims
        report = jobs_finish(outcomes=[Outcome(job_id=claim.job.pk, lease=claim.lease, ok=True, result={})])
        breaker_record(reports=[DispatchReport(executor_id=shared.pk, ok=True)], clean=report.clean)
    # When the next calls are claimed and finished, each costs what is pinned.
    call(alice, a, submit, django_assert_num_queries)
    call(alice, a, submit, django_assert_num_queries)
