"""The claim under other transactions, on PostgreSQL: it passes over a job another transaction
holds (a cancel at that moment), goes on past a worker frozen with the claim lock, and counts
slots freed while it reads once, not twice."""

import threading
import time

import pytest
from django.db import DatabaseError, connection, transaction

from scheduler.connections import worker_database_settings
from scheduler.core.locks import lock_claim
from scheduler.core.state import ClaimState
from scheduler.models import Job, Slot
from scheduler.services.claim import job_claim
from scheduler.services.rounds import round_end
from scheduler.services.submit import job_submit
from tests.scheduler.services.test_rounds import calling, echoed, round_start, submit_flow

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


def test_rounds_that_end_while_a_claim_reads_go_back_to_their_executor(member_setup, make_executor, monkeypatch):
    # Given two flows whose rounds run on x (two slots, both theirs), and y (two free slots) back
    # in placement after they started...
    alice, *_, shared = member_setup
    shared.delete()
    x = make_executor("x", max_concurrency=2)
    y = make_executor("y", max_concurrency=2, enabled=False)
    flows = [submit_flow(alice) for _ in range(2)]
    claims = job_claim(worker="w", limit=2).claims
    assert [claim.executor.name for claim in claims] == ["x", "x"]
    starts = [round_start(claim) for claim in claims]
    y.enabled = True
    y.save()

    # When both rounds end (slots freed, flows queued again preferring x) just after the next
    # claim has read the slot counts with its lock, and before it reads the queue...
    original, ended = ClaimState.load.__func__, threading.Event()

    def end_rounds() -> None:
        try:
            for n, (claim, start) in enumerate(zip(claims, starts, strict=True), 1):
                round_end(
                    job_id=claim.job.pk, lease=claim.lease, round=start.round, message=calling(n), results=[echoed(n)]
                )
            ended.set()
        finally:
            connection.close()

    def load(cls, **kwargs):
        state = original(cls, **kwargs)
        if not ended.is_set():
            ender = threading.Thread(target=end_rounds)
            ender.start()
            ender.join(10)
        return state

    monkeypatch.setattr(ClaimState, "load", classmethod(load))
    batch = job_claim(worker="w", limit=2)

    # Then the claim takes both back to x, which has room for both: their freed slots are not
    # counted against it (once as held, once as taken again).
    assert ended.is_set()
    assert sorted(claim.job.pk for claim in batch.claims) == sorted(flow.pk for flow in flows)
    assert [claim.executor.name for claim in batch.claims] == ["x", "x"]
    assert Slot.objects.filter(executor=x).count() == 2
