"""The claim passes over a job another transaction holds (a cancel at that moment), on PostgreSQL."""

import threading
import time

import pytest
from django.db import connection, transaction

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
