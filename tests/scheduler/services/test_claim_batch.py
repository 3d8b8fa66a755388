"""The claim and a batch's lines (docs/batches.md): a live job is taken before any batch line,
whatever their order of arrival, and batch lines never hold more than the queue policy's
`batch_share` of an executor's slots."""

import pytest
from django.utils import timezone

from scheduler.batches.models import Batch
from scheduler.models import Job, QueuePolicy, Slot
from scheduler.services.claim import job_claim
from scheduler.services.submit import JobSpec, jobs_submit

pytestmark = pytest.mark.django_db


@pytest.fixture
def batch(member_setup):
    alice, _, team, _, _ = member_setup
    now = timezone.now()
    return Batch.objects.create(
        id="batch_test", team=team, user=alice, endpoint="/v1/chat/completions", created_at=now, expires_at=now
    )


def lines(user, team, batch, n, start=1):
    specs = [
        JobSpec(
            team=team.slug,
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
            priority=Job.PRIORITY_MIN,
            batch_id=batch.pk,
            batch_line=start + i,
        )
        for i in range(n)
    ]
    return jobs_submit(user=user, jobs=specs)


def test_batch_lines_hold_at_most_their_share_and_live_jobs_go_first(member_setup, batch, submit):
    # Given an executor of 4 slots, a share of 0.5 and 10 queued batch lines,
    alice, bob, a, b, executor = member_setup
    QueuePolicy.objects.filter(pk=1).update(batch_share=0.5)
    lines(alice, a, batch, 10)
    # when the workers claim all they can, batch lines take 2 slots and leave 2 free;
    taken = job_claim(worker="w", limit=10)
    assert len(taken.claims) == 2 and taken.backlog
    assert Slot.objects.filter(batch=True).count() == 2
    # a live call submitted after them starts at once, before any queued line, in either team.
    live_b = submit(bob, b)
    live_a = submit(alice, a)
    assert sorted(c.job.pk for c in job_claim(worker="w", limit=10).claims) == sorted([live_b.pk, live_a.pk])
    assert Slot.objects.count() == 4 and Slot.objects.filter(batch=True).count() == 2


def test_a_batch_line_does_not_age_past_live_calls(member_setup, batch, submit):
    alice, _, a, _, executor = member_setup
    QueuePolicy.objects.filter(pk=1).update(aging_after_seconds=0, aging_step_seconds=1, aging_max_boost=200)
    executor.max_concurrency = 1
    executor.save()
    QueuePolicy.objects.filter(pk=1).update(batch_share=1.0)
    (line,) = lines(alice, a, batch, 1)
    Job.objects.filter(pk=line.pk).update(queued_at=line.queued_at.replace(year=2000))
    live = submit(alice, a, priority=-99)
    assert [c.job.pk for c in job_claim(worker="w", limit=1).claims] == [live.pk]


def test_two_teams_batches_share_the_leftover_capacity_fairly(member_setup):
    # Given two teams' batches of 10 lines each, team a's submitted first, and 4 slots for lines,
    alice, bob, a, b, _ = member_setup
    QueuePolicy.objects.filter(pk=1).update(batch_share=1.0)
    now = timezone.now()
    batches = [
        Batch.objects.create(id=f"batch_{t.slug}", team=t, user=u, endpoint="x", created_at=now, expires_at=now)
        for t, u in ((a, alice), (b, bob))
    ]
    lines(alice, a, batches[0], 10)
    lines(bob, b, batches[1], 10)
    # when the workers claim, fair share gives each team two, not the first team all four.
    taken = job_claim(worker="w", limit=10).claims
    assert sorted(c.job.team.slug for c in taken) == ["a", "a", "b", "b"]
