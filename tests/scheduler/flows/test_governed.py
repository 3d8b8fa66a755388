"""governed_slot in process (the claim run by the test, as a worker would): it waits for the
claim, holds the lease, bills what is reported; a timeout leaves the queue; recovery fails a slot
whose app died."""

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from quotas.models import QuotaPolicy, Usage
from scheduler import governed_slot
from scheduler.flows import governed
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.claim import job_claim
from scheduler.services.recover import jobs_recover
from scheduler.services.submit import job_submit
from telemachus.control.features import feature_set
from telemachus.errors import FeatureDisabled

pytestmark = pytest.mark.django_db(transaction=True)


def claim_when_queued(job_type: str = "governed") -> None:
    """Play the worker: claim the governed job as soon as it is queued."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if Job.objects.filter(type=job_type, status="queued").exists():
            assert len(job_claim(worker="w", limit=1).claims) == 1
            return
        time.sleep(0.01)
    raise AssertionError("no governed job was queued")


def test_waits_for_its_claim_then_bills_what_it_reports(member_setup):
    alice = member_setup[0]
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=1000, window="day")
    claimer = threading.Thread(target=lambda: (claim_when_queued(), connection.close()))
    claimer.start()
    with governed_slot(user=alice, team="a", model="m", est_tokens=40) as slot:
        assert (slot.executor, slot.kind, slot.model) == ("shared", "sim", "m")
        assert Slot.objects.filter(job_id=slot.job_id).count() == 1
        usage = Usage.objects.get(scope="team", subject="a")
        assert usage.reserved_tokens == 40  # the estimate is held while the slot is
        slot.report(prompt_tokens=12, completion_tokens=30)
    claimer.join()
    job = Job.objects.get(pk=slot.job_id)
    assert (job.status, job.tokens_used, job.rounds, job.result["tokens"]) == ("done", 42, 1, 42)
    assert not Slot.objects.exists()
    usage.refresh_from_db()
    assert (usage.tokens, usage.reserved_tokens) == (42, 0)
    assert list(job.events.values_list("event", flat=True)) == [
        "queued",
        "placed",
        "started",
        "round_started",
        "round_finished",
        "finished",
    ]


def test_the_sync_wait_wakes_on_the_jobs_notification(member_setup, monkeypatch):
    # Given a fallback read only every 60 s, and the reads of the job counted
    alice = member_setup[0]
    monkeypatch.setattr(governed, "WAKE_MAX", 60.0)
    reads = []
    granted = governed.governed_slot._granted
    monkeypatch.setattr(governed.governed_slot, "_granted", lambda self: reads.append(1) or granted(self))
    claimed_at = []

    def claim_late() -> None:
        # When: the claim comes a second after the job is queued (the waiter asleep by then)
        deadline = time.monotonic() + 10
        while not Job.objects.filter(type="governed", status="queued").exists():
            assert time.monotonic() < deadline, "no governed job was queued"
            time.sleep(0.01)
        time.sleep(1.0)
        claimed_at.append(time.monotonic())
        assert len(job_claim(worker="w", limit=1).claims) == 1
        connection.close()

    claimer = threading.Thread(target=claim_late)
    claimer.start()
    with governed_slot(user=alice, team="a", model="m") as slot:
        woke_after = time.monotonic() - claimed_at[0]
    claimer.join()
    # Then: the claim's notification woke it at once, and the job was read only when it changed
    assert woke_after < 2.0, f"woke {woke_after:.2f}s after the claim: on the fallback, not the notification"
    assert len(reads) <= 3, f"{len(reads)} reads: the wait polled the job"
    assert Job.objects.get(pk=slot.job_id).status == "done"


def test_a_timeout_leaves_the_queue(member_setup):
    alice = member_setup[0]
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        with governed_slot(user=alice, team="a", model="m", timeout=0.3):
            pytest.fail("no worker claimed it: the block must not run")
    assert time.monotonic() - started < 5
    assert Job.objects.get(type="governed").status == "canceled"


def test_recovery_fails_a_governed_slot_whose_app_died(member_setup):
    alice = member_setup[0]
    job = job_submit(user=alice, team="a", type="governed", requirements={"model": "m"}, input={})
    job_claim(worker="w", limit=1)
    Job.objects.filter(pk=job.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert jobs_recover().failed == [job.pk]
    assert Job.objects.get(pk=job.pk).status == "failed"
    assert JobEvent.objects.filter(job=job, event="failed").exists()


def test_no_governed_slot_while_flows_are_switched_off(member_setup):
    # Given the flow feature switched off for team a: a governed slot is a flow's model call...
    alice = member_setup[0]
    feature_set(feature="flow", team=member_setup[2], enabled=False, by=None)
    # Then app code asking for one is refused at once, as a flow would be, and nothing is queued.
    with pytest.raises(FeatureDisabled) as refused:
        with governed_slot(user=alice, team="a", model="m", est_tokens=40):
            pass
    assert refused.value.extra["feature"] == "flow"
    assert not Job.objects.exists()
