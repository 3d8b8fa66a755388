"""Cancelling a running job: its slot freed at once, a finished one not cancelled."""

import pytest

from scheduler.models import JobEvent, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.finish import job_finish
from telemachus.errors import Conflict

pytestmark = pytest.mark.django_db


class TestCancelRunning:
    def test_frees_the_slot_at_once(self, running):
        job = job_cancel(job_id=running.job.pk)
        assert job.status == "canceled" and job.lease is None
        assert not Slot.objects.exists()
        assert JobEvent.objects.get(job=job, event="canceled").meta["was"] == "running"

    def test_cancel_of_finished_job_conflicts(self, running):
        job_finish(job_id=running.job.pk, lease=running.lease, result={})
        with pytest.raises(Conflict):
            job_cancel(job_id=running.job.pk)
