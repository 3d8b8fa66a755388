"""A batch's writes from the API: its creation from checked lines, its cancel; and its reads
(counts, lists). The feeder (feeder.py) moves it on from there. Every function runs on a
database thread."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import islice
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q

from scheduler.batches.models import Batch, BatchLine, new_id
from scheduler.models import Job
from scheduler.services.cancel import job_cancel
from telemachus.db.bulk import rows_copy
from telemachus.errors import Conflict, NotFound
from telemachus.models import ApiKey, Team
from telemachus.teams import rbac

# A batch whose input has more invalid lines than this names only the first ones.
MAX_ERRORS = 1000
WINDOWS = {"24h": timedelta(hours=24)}


@dataclass
class CheckedLine:
    """One input line as the gateway checked it: the chat job it becomes, or why it cannot."""

    line: int
    custom_id: str
    requirements: dict[str, Any] = field(default_factory=dict)
    input: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None


class InvalidInput(Exception):
    """The input file cannot be read as a batch: OpenAI's `errors.data`, each naming its line."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} invalid line(s)")
        self.errors = errors


def batch_create(
    *,
    id_prefix: str,
    api: str,
    team: Team,
    user: rbac.Principal,
    key: ApiKey | None,
    endpoint: str,
    input_file_id: str,
    window: timedelta,
    completion_window: str,
    metadata: dict[str, Any] | None,
    lines: Iterable[CheckedLine],
    now: datetime,
    trace: dict[str, str] | None = None,
) -> Batch:
    """Store a batch and its checked lines as they come (the caller reads its input a chunk at a
    time; the lines go COPY_BATCH at a time, by COPY on PostgreSQL), then mark it `in_progress`
    for the feeder. Lines the gateway refused keep their error, and count as refused. If `lines`
    raises InvalidInput, the lines are dropped and the batch is kept `failed` with the errors, as
    OpenAI keeps it. `trace`: the creating request's trace context, which its lines' spans link
    to (scheduler/batches/feeder.py)."""
    batch = Batch(
        id=new_id(id_prefix),
        api=api,
        team=team,
        user=rbac.signed_in(user),
        key=key,
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=completion_window,
        metadata=metadata,
        trace=trace or {},
        created_at=now,
        expires_at=now + window,
    )
    try:
        with transaction.atomic():
            batch.save(force_insert=True)
            rows = _rows(batch, lines)
            # A COPY at a time, of lines already read: reading the input (on this connection)
            # cannot interleave with a COPY under way.
            while chunk := list(islice(rows, COPY_BATCH)):
                rows_copy(BatchLine, LINE_FIELDS, chunk)
            if not batch.lines:
                raise InvalidInput([{"code": "empty_file", "message": "The input file has no lines.", "line": None}])
            batch.status, batch.in_progress_at = Batch.Status.IN_PROGRESS, now
            batch.save(update_fields=["lines", "refused", "status", "in_progress_at"])
    except InvalidInput as invalid:
        batch.lines = batch.refused = 0
        batch.status, batch.failed_at, batch.ended_at = Batch.Status.FAILED, now, now
        batch.errors = {"object": "list", "data": invalid.errors}
        batch.save(force_insert=True)
    return batch


# Lines written per COPY while a batch is created (a few MB of them in memory at most).
COPY_BATCH = 5000
LINE_FIELDS = ("batch_id", "line", "custom_id", "requirements", "input", "meta", "error")


def _rows(batch: Batch, lines: Iterable[CheckedLine]) -> Iterator[tuple[Any, ...]]:
    """Each checked line as a BatchLine row, counting the batch's lines and refusals as they go."""
    for checked in lines:
        batch.lines += 1
        batch.refused += checked.error is not None
        yield (
            batch.pk,
            checked.line,
            checked.custom_id,
            checked.requirements,
            checked.input,
            checked.meta,
            checked.error,
        )


def batch_for(*, team: Team, batch_id: str, api: str) -> Batch:
    """The team's batch of this API (404 for anyone else's)."""
    found = Batch.objects.filter(pk=batch_id, team=team, api=api).first()
    if found is None:
        raise NotFound(
            f"No such batch: {batch_id}. Batches are removed by retention {settings.TELEMACHUS_RETENTION_HOURS:g} "
            "hours after they end, or after their team's own retention_hours."
        )
    return found


def batches_of(*, team: Team, api: str, after: str | None, limit: int) -> list[Batch]:
    """The team's batches, newest first, after the cursor `after` (a batch id)."""
    batches = Batch.objects.filter(team=team, api=api)
    if after:
        cursor = Batch.objects.filter(pk=after, team=team).values_list("created_at", flat=True).first()
        if cursor is not None:
            batches = batches.filter(Q(created_at__lt=cursor) | Q(created_at=cursor, pk__lt=after))
    return list(batches.order_by("-created_at", "-id")[:limit])


@dataclass(frozen=True)
class Counts:
    total: int
    completed: int
    failed: int
    running: int  # queued or running now
    canceled: int  # ended canceled (by a cancel or an expiry)

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}


def batch_counts(*, batch: Batch) -> Counts:
    """Its request counts: from its jobs while it runs (one grouped query), as kept once ended."""
    if batch.counts is not None:
        return Counts(**batch.counts)
    by_status = dict(
        Job.objects.filter(batch=batch)
        .order_by()
        .values_list("status")
        .annotate(n=Count("id"))
        .values_list("status", "n")
    )
    return Counts(
        total=batch.lines,
        completed=by_status.get(Job.Status.DONE, 0),
        failed=by_status.get(Job.Status.FAILED, 0) + batch.refused,
        running=by_status.get(Job.Status.QUEUED, 0) + by_status.get(Job.Status.RUNNING, 0),
        canceled=by_status.get(Job.Status.CANCELED, 0),
    )


def batch_cancel(*, team: Team, batch_id: str, api: str, by: rbac.Principal, now: datetime) -> Batch:
    """Cancel a batch: no line enters the queue from now on (the feeder feeds only batches in
    progress), its queued lines are canceled at once, and its running lines finish and are kept;
    the feeder then writes what was answered and marks it `cancelled`. 409 once it has ended."""
    batch = batch_for(team=team, batch_id=batch_id, api=api)
    if batch.status in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
        return batch
    moved = Batch.objects.filter(pk=batch.pk, status__in=[Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS]).update(
        status=Batch.Status.CANCELLING, cancelling_at=now
    )
    if not moved:
        raise Conflict(f"Batch {batch_id} is already {batch.status} and cannot be cancelled.")
    batch_queued_cancel(batch_id=batch.pk, reason=f"batch {batch_id} cancelled")
    return Batch.objects.get(pk=batch.pk)


def batch_queued_cancel(*, batch_id: str, reason: str) -> int:
    """Cancel the batch's queued lines, each as any job is canceled (its own short transaction);
    one that started meanwhile runs on. How many were canceled."""
    canceled = 0
    queued = Job.objects.filter(batch_id=batch_id, status=Job.Status.QUEUED).order_by("pk").values_list("pk", flat=True)
    for job_id in queued:
        try:
            job_cancel(job_id=job_id, reason=reason)
            canceled += 1
        except Conflict:
            continue
    return canceled
