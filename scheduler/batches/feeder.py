"""The feeder: how a batch moves once created, run by every worker (scheduler/worker/upkeep.py,
`batches`) on a database thread of its own.

Each pass, for each batch under way: at its window's end it expires (its queued lines are
canceled, its running lines finish); once its API key is revoked or expired it is cancelled;
while in progress its next lines enter the queue as jobs of its team, through the one submit
path (`jobs_submit`: RBAC, feature switches, the key's models, budgets, the depth cap), so that
at most TELEMACHUS_BATCH_WINDOW of its lines are queued or running at a time; once none is, its
output and error files are written and it ends.

Any number of workers feed at once, safely: lines enter in order, and the batch's `fed` mark moves
only from what the feeder read (a conditional UPDATE in the submit's transaction), and a line
enters the queue once (the unique batch line of a job); a feeder that loses either race writes
nothing. The files are written in the transaction that ends the batch, by one feeder alone (the
same conditional UPDATE on its status). A worker or an API process killed at any point loses no
line and writes none twice: the lines are rows, their jobs are rows, and the files are derived
from both when the batch ends."""

import logging
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from scheduler.batches.models import Batch, BatchLine
from scheduler.batches.output import outputs_write
from scheduler.batches.services import batch_counts, batch_queued_cancel
from scheduler.models import Job
from scheduler.services.submit import BUDGET_FAIL, JobSpec, jobs_submit
from telemachus import tracing
from telemachus.control.features import OPENAI
from telemachus.db.compiled import CompiledQuery
from telemachus.errors import DomainError, TryLater

log = logging.getLogger("telemachus.batches")


# Whether any batch is under way, compiled once (telemachus/db/compiled.py): building the pass's
# query with its three joined models cost a worker about 1 % of a core with no batch at all.
_UNDER_WAY: CompiledQuery[tuple[str]] = CompiledQuery(
    lambda: Batch.objects.filter(status__in=Batch.ACTIVE).order_by().values_list("pk")[:1]
)


class _Lost(Exception):
    """Another feeder moved the batch first: this one's writes are rolled back."""


def batches_advance() -> int:
    """One pass over the batches under way; how many lines entered the queue or batches moved
    (the caller passes again at once when any did)."""
    if not _UNDER_WAY():  # every pass of every worker, twice a second: most find none
        return 0
    now = timezone.now()
    moved = 0
    for batch in Batch.objects.filter(status__in=Batch.ACTIVE).select_related("team", "user", "key"):
        try:
            moved += _advance(batch, now=now)
        except _Lost:
            moved += 1
    return moved


def _advance(batch: Batch, *, now: datetime) -> int:
    key = batch.key
    if (
        batch.status == Batch.Status.IN_PROGRESS
        and key is not None
        and (key.revoked_at is not None or (key.expires_at is not None and key.expires_at <= now))
    ):
        # Its key no longer works: nothing more of it starts, as with a cancel.
        if Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS).update(
            status=Batch.Status.CANCELLING, cancelling_at=now
        ):
            batch_queued_cancel(batch_id=batch.pk, reason=f"batch {batch.pk}: its API key was revoked or expired")
        return 1
    if batch.status == Batch.Status.IN_PROGRESS and now >= batch.expires_at:
        if Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS).update(
            status=Batch.Status.FINALIZING, finalizing_at=now, expired_at=now
        ):
            batch_queued_cancel(batch_id=batch.pk, reason=f"batch {batch.pk} expired")
        return 1
    counts = batch_counts(batch=batch)
    if batch.status == Batch.Status.IN_PROGRESS and batch.fed < batch.lines:
        room = settings.TELEMACHUS_BATCH_WINDOW - counts.running
        return _feed(batch, room=room) if room > 0 else 0
    if counts.running:
        return 0
    if batch.status == Batch.Status.IN_PROGRESS:
        if not Batch.objects.filter(pk=batch.pk, status=Batch.Status.IN_PROGRESS).update(
            status=Batch.Status.FINALIZING, finalizing_at=now
        ):
            return 0
        batch.status = Batch.Status.FINALIZING
    if batch.status == Batch.Status.CANCELLING:
        _end(batch, to=Batch.Status.CANCELLED, ending="batch_cancelled", now=now)
    elif batch.expired_at is not None:
        _end(batch, to=Batch.Status.EXPIRED, ending="batch_expired", now=now)
    else:
        _end(batch, to=Batch.Status.COMPLETED, ending="batch_expired", now=now)
    return 1


def _feed(batch: Batch, *, room: int) -> int:
    """The batch's next `room` lines into the queue, with their lines' refusals: one transaction."""
    lines = list(BatchLine.objects.filter(batch=batch, line__gt=batch.fed).order_by("line")[:room])
    if not lines:
        return 0
    todo = [line for line in lines if line.error is None]
    spans = _line_spans(batch, todo)
    refused: list[BatchLine] = []
    jobs: list[Job] = []
    attributes = {"telemachus.batch.id": batch.pk, "telemachus.batch.lines": len(lines)}
    try:
        with transaction.atomic(), tracing.span("batch.feed", link=batch.trace, attributes=attributes):
            while todo:
                try:
                    specs = [_spec(batch, line, trace=spans[line.pk][1] if spans else None) for line in todo]
                    jobs = jobs_submit(user=batch.user, jobs=specs, key=batch.key)
                    break
                except TryLater:
                    raise  # the team's queue is full: this pass feeds nothing
                except DomainError as exc:
                    index = exc.extra.pop("index", None)
                    if index is None:
                        raise
                    line = todo.pop(index)
                    line.error = {**exc.body(), "code": exc.code, "message": exc.detail, "line": line.line}
                    BatchLine.objects.filter(pk=line.pk).update(error=line.error)
                    refused.append(line)
            if not Batch.objects.filter(pk=batch.pk, fed=batch.fed, status=Batch.Status.IN_PROGRESS).update(
                fed=lines[-1].line, refused=F("refused") + len(refused)
            ):
                raise _Lost
    except TryLater:
        return 0
    except IntegrityError as exc:  # another feeder put one of these lines in the queue first
        raise _Lost from exc
    if spans:
        _line_spans_end(spans, fed=zip(todo, jobs, strict=True), refused=refused)
    return len(lines)


def _line_spans(batch: Batch, lines: list[BatchLine]) -> dict[int, tuple[Any, dict[str, str]]]:
    """While tracing, for a batch whose creation was traced: each line's `batch.line` span, the
    root of the line's own trace (its job's spans join it), linked to the batch's creation, with
    the context its job keeps. Ended once the lines are in the queue; the spans of a feed that
    another feeder won are never ended, so never exported."""
    if not (tracing.active and batch.trace):
        return {}
    spans = {}
    for line in lines:
        span = tracing.span_started(
            "batch.line",
            link=batch.trace,
            attributes={
                "telemachus.batch.id": batch.pk,
                "telemachus.batch.line": line.line,
                "telemachus.batch.custom_id": line.custom_id,
                "telemachus.team": batch.team.slug,
                "gen_ai.request.model": str(line.requirements.get("model", "")),
            },
        )
        spans[line.pk] = (span, tracing.span_carrier(span))
    return spans


def _line_spans_end(
    spans: dict[int, tuple[Any, dict[str, str]]], *, fed: Iterable[tuple[BatchLine, Job]], refused: list[BatchLine]
) -> None:
    for line, job in fed:
        span, _ = spans[line.pk]
        span.set_attribute("telemachus.job.id", job.pk)
        span.end()
    for line in refused:
        span, _ = spans[line.pk]
        tracing.span_failed(span, f"refused: {line.error['code'] if line.error else ''}")
        span.end()


def _spec(batch: Batch, line: BatchLine, *, trace: dict[str, str] | None = None) -> JobSpec:
    """A line as the chat job it becomes: of the batch's team, at the lowest priority (a batch
    line waits behind every live call: docs/batches.md), ending with the quota error when its
    budget is spent rather than waiting for the window to reset; `trace`: its span's context."""
    return JobSpec(
        team=batch.team.slug,
        type=Job.Type.CHAT,
        requirements={**line.requirements, "on_budget_exhausted": BUDGET_FAIL},
        input=line.input,
        priority=Job.PRIORITY_MIN,
        meta={**line.meta, "via": "batch", "batch": batch.pk, "custom_id": line.custom_id},
        features=(OPENAI,),
        batch_id=batch.pk,
        batch_line=line.line,
        trace=trace,
    )


def _end(batch: Batch, *, to: str, ending: str, now: datetime) -> None:
    """Write its files and end it, in one transaction, if no other feeder ended it first."""
    with transaction.atomic():
        written = outputs_write(batch, now=now, ending=ending)
        stamp = {
            Batch.Status.COMPLETED: "completed_at",
            Batch.Status.CANCELLED: "cancelled_at",
            Batch.Status.EXPIRED: "expired_at",
        }[Batch.Status(to)]
        counts = {
            "total": batch.lines,
            "completed": written.completed,
            "failed": written.failed,
            "running": 0,
            "canceled": written.canceled,
        }
        if not Batch.objects.filter(pk=batch.pk, status=batch.status).update(
            status=to,
            output_file_id=written.output.pk if written.output else "",
            error_file_id=written.errors.pk if written.errors else "",
            counts=counts,
            ended_at=now,
            **{stamp: now},
        ):
            raise _Lost
    log.info("batch %s %s: %s", batch.pk, to, counts)
