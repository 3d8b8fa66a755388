"""The claim passes over a job another transaction holds (a cancel at that moment), on PostgreSQL."""

import threading
import time

import pytest
from django.db import DatabaseError, connection, transaction

from scheduler.connections import worker_database_settings
from scheduler.core.locks import lock_claim
from scheduler.models import Job
from scheduler.services.claim import job_claim
from scheduler.services.submit import job_submit

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_a_job_locked_elsewhere_is_skipped_not_waited_for(member_setup):
    # Given two queued jobs, the first held by another transaction (as a cancel holds it)...
    alice = member_setup[0]
    held, free = (
        job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
        for _ in range(2)
    )
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=held.pk)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)

        # When a worker claims both...
        started = time.monotonic()
        batch = job_claim(worker="w", limit=2)
        waited = time.monotonic() - started
    finally:
        release.set()
        holder.join()

    # Then it takes the free one at once, and the held one stays queued for a later claim.
    assert [claim.job.pk for claim in batch.claims] == [free.pk]
    assert waited < 5
    assert Job.objects.get(pk=held.pk).status == "queued"
    assert [claim.job.pk for claim in job_claim(worker="w", limit=2).claims] == [held.pk]


def test_a_worker_frozen_holding_the_claim_lock_is_cut_off_and_claims_go_on(member_setup, settings):
    # Given a worker's connection (the worker's own session settings, a 1 s idle-in-transaction
    # bound; behind PgBouncer the pooler's idle_transaction_timeout instead, 2 s in
    # bin/pgbouncer-test) that takes the claim lock and then freezes, as a stopped worker would
    # mid-claim...
    settings.TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS = 1
    job = job_submit(user=member_setup[0], team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    locked, outcome = threading.Event(), []

    def frozen_worker() -> None:
        connection.settings_dict = worker_database_settings(connection.settings_dict)
        try:
            with transaction.atomic():
                lock_claim()
                locked.set()
                time.sleep(8)  # frozen, far past the bound
                Job.objects.count()  # what it does when it resumes
            outcome.append("committed")
        except DatabaseError as exc:
            outcome.append(type(exc).__name__)
        finally:
            locked.set()
            connection.close()

    holder = threading.Thread(target=frozen_worker)
    holder.start()
    try:
        assert locked.wait(10)
        # When another worker claims...
        started = time.monotonic()
        (claim,) = job_claim(worker="w2", limit=1).claims
        waited = time.monotonic() - started
    finally:
        holder.join(20)

    # Then it waited for the bound, not for the frozen worker: the server (or the pooler) ended
    # that session (its transaction rolled back, its lock gone), and the frozen worker learns so
    # when it resumes.
    assert claim.job.pk == job.pk and waited < 5
    assert outcome and outcome[0] != "committed"


def test_the_claims_clock_is_read_once_it_holds_the_claim_lock(member_setup):
    # Given another claim holding the claim lock for a while (the lock and the clock are sent to
    # the server together: telemachus/db/pipeline.py)...
    with transaction.atomic():
        lock_claim()  # the policy row exists before the race
    locked, released = threading.Event(), []

    def holder() -> None:
        try:
            with transaction.atomic():
                lock_claim()
                locked.set()
                time.sleep(0.5)
                with connection.cursor() as cursor:
                    cursor.execute("SELECT clock_timestamp()")
                    released.append(cursor.fetchone()[0])
        finally:
            locked.set()
            connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert locked.wait(10)
        # When a claim takes the lock after it...
        with transaction.atomic():
            _, now = lock_claim()
    finally:
        thread.join(10)

    # Then its clock reads a time after the other released the lock, not when its statements
    # were sent.
    assert released and now > released[0]
