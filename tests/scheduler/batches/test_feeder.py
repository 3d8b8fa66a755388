"""The feeder in this process (scheduler/batches/feeder.py): lines enter the queue in order,
within the window; a batch whose key is revoked stops and ends cancelled, each line answered once."""

import json

import pytest
from django.utils import timezone

from scheduler.batches.feeder import batches_advance
from scheduler.batches.files import file_lines
from scheduler.batches.models import Batch, BatchLine
from scheduler.live.snapshot import queue_snapshot
from scheduler.models import Job
from telemachus.keys.services import api_key_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def batch_of(member_setup):
    alice, _, team, _, _ = member_setup

    def make(lines: int, **fields) -> Batch:
        now = timezone.now()
        batch = Batch.objects.create(
            id=f"batch_t{Batch.objects.count()}",
            team=team,
            user=alice,
            endpoint="/v1/chat/completions",
            status=Batch.Status.IN_PROGRESS,
            lines=lines,
            created_at=now,
            expires_at=now + timezone.timedelta(hours=24),
            **fields,
        )
        BatchLine.objects.bulk_create(
            BatchLine(
                batch=batch,
                line=n,
                custom_id=f"c{n}",
                requirements={"model": "m"},
                input={"messages": [{"role": "user", "content": "hi"}]},
                meta={"model": "m"},
            )
            for n in range(1, lines + 1)
        )
        return batch

    return make


def test_lines_enter_in_order_within_the_window(batch_of, settings):
    settings.TELEMACHUS_BATCH_WINDOW = 4
    batch = batch_of(10)
    batches_advance()
    batches_advance()  # the window is full: nothing more enters
    assert sorted(Job.objects.filter(batch=batch).values_list("batch_line", flat=True)) == [1, 2, 3, 4]
    batch.refresh_from_db()
    assert batch.fed == 4 and {j.priority for j in Job.objects.filter(batch=batch)} == {Job.PRIORITY_MIN}


def test_the_dashboard_shows_each_batch_under_way_to_its_team(batch_of, member_setup, settings):
    alice, bob, _, _, _ = member_setup
    settings.TELEMACHUS_BATCH_WINDOW = 4
    batch = batch_of(10)
    batches_advance()
    (row,) = queue_snapshot(user=alice)["batches"]
    assert (row["id"], row["team"], row["status"], row["total"], row["running"]) == (
        batch.pk,
        "a",
        "in_progress",
        10,
        4,
    )
    assert queue_snapshot(user=bob)["batches"] == []


def test_a_revoked_key_cancels_the_batch(batch_of, member_setup):
    _, _, team, _, _ = member_setup
    key, _ = api_key_create(team=team, name="app")
    batch = batch_of(3, key=key)
    key.revoked_at = timezone.now()
    key.save()
    batches_advance()
    assert Batch.objects.get(pk=batch.pk).status == Batch.Status.CANCELLING
    batches_advance()
    ended = Batch.objects.get(pk=batch.pk)
    assert ended.status == Batch.Status.CANCELLED and not Job.objects.filter(batch=batch).exists()
    errors = [json.loads(line) for line in file_lines(file_id=ended.error_file_id)]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("c1", "batch_cancelled"),
        ("c2", "batch_cancelled"),
        ("c3", "batch_cancelled"),
    ]
    assert ended.output_file_id == "" and ended.counts["canceled"] == 3
