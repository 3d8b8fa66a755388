"""The claim's commit does not wait for the WAL flush on PostgreSQL (docs/gateway.md, "The claim's
commit"): set for the claim's transaction alone, from the statement that reads the clock under the
claim lock, so it costs no round trip; every other transaction keeps the server's setting."""

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from scheduler.core.locks import lock_claim
from scheduler.services.claim import job_claim

pytestmark = pytest.mark.django_db(transaction=True)


def synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return cursor.fetchone()[0]


def test_the_claim_commits_unflushed_and_nothing_after_it_does(member_setup, submit):
    if connection.vendor != "postgresql":
        pytest.skip("synchronous_commit is PostgreSQL's")
    # Given a queued job...
    alice, _, a, _, _ = member_setup
    submit(alice, a)
    # When a worker claims it...
    with CaptureQueriesContext(connection) as claim:
        assert len(job_claim(worker="w").claims) == 1

    # Then the statement that read the clock under the claim lock also turned the flush off, and
    # the claim ran no statement of its own for it (on a flushed database, whose policy row the
    # claim creates first, the clock is read twice: before the lock and again with it)...
    setting = [q["sql"] for q in claim.captured_queries if "synchronous_commit" in q["sql"]]
    assert setting and all(sql.startswith("SELECT STATEMENT_TIMESTAMP()") for sql in setting)
    # ...for its own transaction only: the next one flushes as the server says.
    assert synchronous_commit() == "on"


def test_the_policy_editor_reads_under_the_claim_lock_with_its_commit_flushed(transactional_db):
    if connection.vendor != "postgresql":
        pytest.skip("synchronous_commit is PostgreSQL's")
    with transaction.atomic():
        lock_claim(as_stored=True)
        assert synchronous_commit() == "on"
    with transaction.atomic():
        lock_claim(commit_unflushed=True)
        assert synchronous_commit() == "off"
