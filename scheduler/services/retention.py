"""Retention: what ended long enough ago is deleted, and prompts and answers go sooner when a team
says so (docs/retention.md).

  jobs       a job that ended (done, failed, canceled) more than its team's `retention_hours`
             ago (empty: TELEMACHUS_RETENTION_HOURS) is deleted with its events and any slot
             left of it. A flow is one job whose rounds live in its row and its events, so it
             goes whole, once its last round ended it. What /metrics counts of the deleted
             jobs is kept, summed, in JobTally.
  bodies     a job that ended more than its team's `body_retention_hours` ago (0: at once) loses
             its prompt and answer: input's messages, texts and arguments, its conversation and
             its result; its model, tokens, cost, times, status, error and events stay. A caller
             still waiting for the answer holds it (`Job.body_hold_until`) until its deadline.
  ledger     usage ledger windows that ended more than the deployment's retention ago and hold
             nothing reserved. Spend rows are the daily aggregate that /api/spend/ reads: kept.
  batches    a batch that ended more than its team's `retention_hours` ago, once its lines'
             jobs are gone (they ended before it), is deleted with its lines and its output and
             error files; an uploaded file as old, once no batch under way reads it. After the
             team's `body_retention_hours` an ended batch loses its lines (their prompts), its
             input file and its output file (the answers); its counts and error file stay.
  audit      audit events older than TELEMACHUS_AUDIT_RETENTION_DAYS.
  webhooks   deliveries that were sent or gave up, with their attempts, and executor events
             (breaker, health), after the deployment's retention.

Each batch is one short transaction of at most TELEMACHUS_PRUNE_BATCH rows, taken oldest first
through an index and locked SKIP LOCKED (telemachus/db/prune.py): it waits on no claim, submit or
finish, and none waits on it (the rows it deletes are ones they no longer touch). The workers run
`prune_once` every TELEMACHUS_PRUNE_INTERVAL_SECONDS (scheduler/worker/upkeep.py); the command
`telemachus_prune` runs it until nothing is left, for a backlog."""

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, Model, OuterRef, Q, QuerySet
from django.utils import timezone

from quotas.models import QuotaPolicy, Spend, Usage
from scheduler.batches.models import Batch, BatchLine, FileChunk, StoredFile
from scheduler.models import Job, JobEvent, JobTally, Slot
from telemachus.db.bulk import update_rows, upsert_add
from telemachus.db.locks import Level, rows_lock
from telemachus.db.prune import rows_prune
from telemachus.db.sizes import rows_estimate
from telemachus.models import AuditEvent, Team, WebhookAttempt, WebhookDelivery

# The keys of a job's input that hold what was said (chat messages, an embedding's or a
# translation's texts, a tool's or a task's arguments, instructions): removed with the body. The
# rest (max_tokens, stream, a task's callable, a flow's tool names) describe the call and stay.
BODY_KEYS = ("messages", "input", "text", "prompt", "instructions", "system", "arguments", "args", "kwargs")
# Executor events: the job-less events retention deletes by age (the index on (event, at)).
EXECUTOR_EVENTS = (
    JobEvent.Type.BREAKER_OPENED,
    JobEvent.Type.BREAKER_HALF_OPEN,
    JobEvent.Type.BREAKER_CLOSED,
    JobEvent.Type.HEALTH_CHANGED,
)
WINDOW_LENGTH = {
    QuotaPolicy.Window.MINUTE: timedelta(minutes=1),
    QuotaPolicy.Window.HOUR: timedelta(hours=1),
    QuotaPolicy.Window.DAY: timedelta(days=1),
    QuotaPolicy.Window.MONTH: timedelta(days=31),
}


def job_missing(job_id: int) -> str:
    """What the API says of a job it does not show: the same for one that never was, one of
    another team and one retention deleted (nothing leaks which), naming retention as a cause."""
    return (
        f"Job {job_id} not found. Finished jobs are removed by retention "
        f"{settings.TELEMACHUS_RETENTION_HOURS:g} hours after they end, or after their team's own retention_hours."
    )


@dataclass(frozen=True)
class TeamRetention:
    """What a team keeps: finished jobs for `hours`, their bodies for `body_hours` (None: as long
    as the jobs)."""

    team_id: int
    hours: float
    body_hours: float | None


def retention_in_force() -> list[TeamRetention]:
    """Every team's retention, its own or the deployment's. One read of the team rows; no lock."""
    default = settings.TELEMACHUS_RETENTION_HOURS
    teams = Team.objects.order_by("pk").values_list("pk", "retention_hours", "body_retention_hours")
    kept = []
    for team_id, hours, body_hours in teams:
        hours = default if hours is None else hours
        kept.append(TeamRetention(team_id, hours, None if body_hours is None or body_hours >= hours else body_hours))
    return kept


# The tables retention keeps in bounds, as the dashboard names them.
RETAINED_TABLES: dict[str, type[Model]] = {
    "jobs": Job,
    "job events": JobEvent,
    "usage windows": Usage,
    "spend days": Spend,
    "audit events": AuditEvent,
    "webhook deliveries": WebhookDelivery,
    "batches": Batch,
    "batch lines": BatchLine,
    "file chunks": FileChunk,
}


def retention_overview() -> dict[str, Any]:
    """What the dashboard shows operators of retention: the deployment's settings and about how
    many rows each table holds (telemachus/db/sizes.py: an estimate on PostgreSQL). No lock."""
    estimates = rows_estimate(list(RETAINED_TABLES.values()))
    return {
        "hours": settings.TELEMACHUS_RETENTION_HOURS,
        "audit_days": settings.TELEMACHUS_AUDIT_RETENTION_DAYS,
        "tables": {name: estimates[model] for name, model in RETAINED_TABLES.items()},
    }


@dataclass
class PruneReport:
    """Rows deleted (or bodies removed) per table in one run."""

    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, table: str, n: int) -> None:
        if n:
            self.counts[table] += n

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _hours_ago(now: datetime, hours: float) -> datetime:
    return now - timedelta(hours=hours)


def _ended(team_id: int, cutoff: datetime) -> "QuerySet[Job]":
    """A team's jobs that ended before `cutoff` and are nobody's parent, in the shape of the two
    partial indexes (`job_ended_idx`, `job_stripped_idx`) so each batch is an index range."""
    return Job.objects.filter(team_id=team_id, finished_at__lt=cutoff).exclude(
        Exists(Job.objects.filter(parent_flow=OuterRef("pk")))
    )


def jobs_prune_batch(*, team_id: int, cutoff: datetime, limit: int) -> int:
    """Delete up to `limit` of a team's jobs that ended before `cutoff` (those with their body
    first, then those without), with their events and slots, and add what /metrics counts of
    them to JobTally. Durable; locks the job rows it deletes (level 3, SKIP LOCKED), then the
    tally rows (level 4, by their upsert). Returns the jobs deleted."""
    # A job a caller still waits on (`body_hold_until`) stays, with its body, however short its
    # team's retention.
    unheld = Q(body_hold_until__isnull=True) | Q(body_hold_until__lt=timezone.now())
    shapes = (
        Q(status__in=Job.TERMINAL, body_removed_at__isnull=True) & unheld,
        Q(body_removed_at__isnull=False),
    )
    deleted: list[tuple[Any, ...]] = []
    with transaction.atomic(durable=True):
        for shape in shapes:
            left = limit - len(deleted)
            if left <= 0:
                break
            deleted += rows_prune(
                _ended(team_id, cutoff).filter(shape),
                order=("finished_at",),
                limit=left,
                level=Level.JOB,
                children=((JobEvent, "job"), (Slot, "job")),
                returning=("team", "type", "status", "tokens_used", "submitted_at", "started_at"),
            )
        _tally(deleted)
    return len(deleted)


def wait_bucket(submitted_at: datetime, started_at: datetime | None) -> tuple[int, float]:
    """The bucket of /metrics' wait histogram a job's queue wait falls in, and the wait."""
    if started_at is None:
        return -1, 0.0
    wait = (started_at - submitted_at).total_seconds()
    for index, bound in enumerate(JobTally.WAIT_BOUNDS):
        if wait <= bound:
            return index, wait
    return len(JobTally.WAIT_BOUNDS), wait


def _tally(deleted: list[tuple[Any, ...]]) -> None:
    sums: dict[tuple[int, str, str, int], list[Any]] = defaultdict(lambda: [0, 0, 0.0])
    for team_id, kind, status, tokens, submitted_at, started_at in deleted:
        bucket, wait = wait_bucket(submitted_at, started_at)
        row = sums[(team_id, kind, status, bucket)]
        row[0] += 1
        row[1] += tokens or 0
        row[2] += wait
    upsert_add(
        JobTally,
        {k: tuple(v) for k, v in sums.items()},
        keys=("team", "type", "status", "wait_bucket"),
        adds=("jobs", "tokens", "wait_seconds"),
    )


def body_stripped(input: dict[str, Any]) -> dict[str, Any]:
    """A job's input without what was said in it (BODY_KEYS)."""
    return {key: value for key, value in input.items() if key not in BODY_KEYS}


def bodies_remove_batch(*, team_id: int, cutoff: datetime, now: datetime, limit: int) -> int:
    """Remove the prompt and answer of up to `limit` of a team's jobs that ended before `cutoff`
    and that no waiting caller holds any more (`body_hold_until` passed). Durable; locks those job
    rows (level 3, SKIP LOCKED: a job someone else holds is done next time). Returns how many."""
    with transaction.atomic(durable=True):
        due = Job.objects.filter(
            team_id=team_id, status__in=Job.TERMINAL, body_removed_at__isnull=True, finished_at__lt=cutoff
        ).filter(Q(body_hold_until__isnull=True) | Q(body_hold_until__lt=now))
        locked = rows_lock(due, level=Level.JOB, skip_locked=True, of=("self",))
        rows = list(locked.order_by("finished_at").values_list("pk", "input", "meta")[:limit])
        update_rows(
            Job,
            [
                {
                    "id": pk,
                    "input": body_stripped(input or {}),
                    "result": None,
                    "conversation": [],
                    "meta": _meta_stripped(meta or {}),
                    "body_removed_at": now,
                }
                for pk, input, meta in rows
            ],
        )
    return len(rows)


def _meta_stripped(meta: dict[str, Any]) -> dict[str, Any]:
    """A job's meta without what was said: a batch line of /v1/responses keeps the request's
    `instructions` in `meta.context` to shape its answer (scheduler/gateway/batches/lines.py)."""
    if not isinstance(meta.get("context"), dict):
        return meta
    return {**meta, "context": body_stripped(meta["context"])}


def _batches_ended(team_id: int, cutoff: datetime) -> "QuerySet[Batch]":
    """A team's batches that ended before `cutoff`, in the shape of `batch_ended_idx`."""
    return Batch.objects.filter(team_id=team_id, ended_at__lt=cutoff)


def _files_delete(file_ids: list[str]) -> None:
    """Delete stored files and their bytes (one DELETE each: no chunk is read)."""
    ids = [file_id for file_id in file_ids if file_id]
    if ids:
        FileChunk.objects.filter(file_id__in=ids).delete()
        StoredFile.objects.filter(pk__in=ids).delete()


def _input_file_free(batch: Batch) -> bool:
    """Whether no other batch that has not ended reads `batch`'s input file."""
    others = Batch.objects.filter(input_file_id=batch.input_file_id, ended_at__isnull=True)
    return not others.exclude(pk=batch.pk).exists()


def batches_prune_batch(*, team_id: int, cutoff: datetime, limit: int) -> int:
    """Delete up to `limit` of a team's batches that ended before `cutoff` and have no job left
    (their lines' jobs ended before them, so retention deletes those first; one it skipped, a
    locked row, keeps its batch until the next pass), with their lines and their output and
    error files. Durable; locks the batch rows (level 8, SKIP LOCKED). Returns the batches."""
    rows = _batches_ended(team_id, cutoff).exclude(Exists(Job.objects.filter(batch=OuterRef("pk"))))
    with transaction.atomic(durable=True):
        deleted = rows_prune(
            rows,
            order=("ended_at",),
            limit=limit,
            level=Level.RETAINED,
            children=((BatchLine, "batch"),),
            returning=("output_file_id", "error_file_id"),
        )
        _files_delete([file_id for row in deleted for file_id in row])
    return len(deleted)


def files_prune_batch(*, team_id: int, cutoff: datetime, limit: int) -> int:
    """Delete up to `limit` of a team's uploaded files (purpose `batch`) created before `cutoff`
    that no batch under way reads, with their bytes. Durable; locks the file rows (level 8,
    SKIP LOCKED). Returns the files."""
    reading = Batch.objects.filter(input_file_id=OuterRef("pk"), ended_at__isnull=True)
    rows = StoredFile.objects.filter(team_id=team_id, purpose=StoredFile.Purpose.BATCH, created_at__lt=cutoff)
    with transaction.atomic(durable=True):
        return len(
            rows_prune(
                rows.exclude(Exists(reading)),
                order=("created_at",),
                limit=limit,
                level=Level.RETAINED,
                children=((FileChunk, "file"),),
            )
        )


def batch_bodies_remove_batch(*, team_id: int, cutoff: datetime, now: datetime, limit: int) -> int:
    """Remove the prompts and answers of a team's batches that ended before `cutoff`: delete up
    to `limit` of their lines (which hold the prompts; an ended batch never reads them again),
    and, for a batch whose last lines went, its output file (the answers) and its input file,
    unless another batch under way reads that one. Its counts, error file and jobs' remains
    stay. Durable; locks the batch rows (level 8, SKIP LOCKED). Returns the lines deleted and
    the batches done."""
    due = _batches_ended(team_id, cutoff).filter(body_removed_at__isnull=True)
    removed = 0
    with transaction.atomic(durable=True):
        for batch in rows_lock(due, level=Level.RETAINED, skip_locked=True).order_by("ended_at")[:limit]:
            left = limit - removed
            if left <= 0:
                break
            lines = rows_prune(BatchLine.objects.filter(batch=batch), order=("line",), limit=left, level=Level.RETAINED)
            removed += len(lines)
            if len(lines) == left:
                break  # it may have more: the next batch of the drain goes on with them
            _files_delete([batch.output_file_id, batch.input_file_id if _input_file_free(batch) else ""])
            Batch.objects.filter(pk=batch.pk).update(body_removed_at=now, output_file_id="")
            removed += 1
    return removed


# A team whose jobs go sooner than this after they end has its waiting callers hold them: a wait
# lasts at most the gateway's timeout (600 s by default), so an hour covers every default.
HOLD_BELOW_HOURS = 1.0


def team_holds() -> Q:
    """The teams (as a condition on a job's `team`) whose jobs or bodies may go while a caller
    still waits for the answer: those that remove bodies early, or keep jobs less than
    HOLD_BELOW_HOURS (every team, when the deployment does)."""
    if settings.TELEMACHUS_RETENTION_HOURS < HOLD_BELOW_HOURS:
        return (
            Q(team__retention_hours__isnull=True)
            | Q(team__retention_hours__lt=HOLD_BELOW_HOURS)
            | Q(team__body_retention_hours__isnull=False)
        )
    return Q(team__body_retention_hours__isnull=False) | Q(team__retention_hours__lt=HOLD_BELOW_HOURS)


def holds_for(team: Team) -> bool:
    """Whether a waiting caller of a job of `team` holds it (`team_holds`, for one team row)."""
    hours = settings.TELEMACHUS_RETENTION_HOURS if team.retention_hours is None else team.retention_hours
    return team.body_retention_hours is not None or hours < HOLD_BELOW_HOURS


def body_hold(*, job_id: int, until: datetime) -> bool:
    """A caller waits for the job's answer until `until` (a /wait/, a stream): the job and its
    body are kept till then, if its team could remove them sooner (`team_holds`) and it still
    has its body. Returns whether it is held (False: nothing to hold, so the caller need not
    renew it). One UPDATE of the job's row, in autocommit; only such teams pay for it."""
    held = Job.objects.filter(team_holds(), pk=job_id, body_removed_at__isnull=True)
    if held.filter(Q(body_hold_until__isnull=True) | Q(body_hold_until__lt=until)).update(body_hold_until=until):
        return True
    return held.exists()


def body_hold_release(*, job_id: int) -> None:
    """The caller that held the job's body (a /v1/ call) has its answer: the body may go now."""
    Job.objects.filter(pk=job_id, body_hold_until__isnull=False).update(body_hold_until=None)


def usage_prune_batch(*, now: datetime, limit: int) -> int:
    """Delete up to `limit` usage ledger windows that ended more than the deployment's retention
    ago and hold no reservation (an attempt still running settles into its window). Durable;
    locks those ledger rows (level 4, SKIP LOCKED)."""
    cutoff = _hours_ago(now, settings.TELEMACHUS_RETENTION_HOURS)
    ended = Q()
    for window, length in WINDOW_LENGTH.items():
        ended |= Q(window=window, window_start__lt=cutoff - length)
    # Implied by `ended`, and what lets each batch be a range of usage_window_start_idx rather
    # than a walk of it that ends at its last row.
    started = Q(window_start__lt=cutoff - min(WINDOW_LENGTH.values()))
    rows = Usage.objects.filter(started, ended, reserved_tokens=0, reserved_requests=0, reserved_cost=0)
    with transaction.atomic(durable=True):
        return len(rows_prune(rows, order=("window_start",), limit=limit, level=Level.USAGE))


def audit_prune_batch(*, now: datetime, limit: int) -> int:
    """Delete up to `limit` audit events older than TELEMACHUS_AUDIT_RETENTION_DAYS. Durable."""
    cutoff = now - timedelta(days=settings.TELEMACHUS_AUDIT_RETENTION_DAYS)
    with transaction.atomic(durable=True):
        return len(
            rows_prune(AuditEvent.objects.filter(at__lt=cutoff), order=("at",), limit=limit, level=Level.RETAINED)
        )


def webhooks_prune_batch(*, now: datetime, limit: int) -> int:
    """Delete up to `limit` webhook deliveries that were sent or gave up more than the
    deployment's retention ago, oldest first (webhookdelivery_created_idx), with their attempts
    (by their delivery's index). Durable; locks them (level 7, SKIP LOCKED:
    never a delivery the delivery loop holds)."""
    cutoff = _hours_ago(now, settings.TELEMACHUS_RETENTION_HOURS)
    rows = WebhookDelivery.objects.exclude(status=WebhookDelivery.Status.PENDING).filter(created_at__lt=cutoff)
    with transaction.atomic(durable=True):
        return len(
            rows_prune(
                rows,
                order=("created_at",),
                limit=limit,
                level=Level.WEBHOOK_DELIVERY,
                children=((WebhookAttempt, "delivery"),),
            )
        )


def executor_events_prune_batch(*, now: datetime, limit: int) -> int:
    """Delete up to `limit` executor events (no job) older than the deployment's retention. Durable."""
    cutoff = _hours_ago(now, settings.TELEMACHUS_RETENTION_HOURS)
    rows = JobEvent.objects.filter(job__isnull=True, event__in=EXECUTOR_EVENTS, at__lt=cutoff)
    with transaction.atomic(durable=True):
        return len(rows_prune(rows, order=("event", "at"), limit=limit, level=Level.RETAINED))


def prune_once(*, limit: int | None = None, pace: float = 0.0, more: Callable[[], bool] = lambda: True) -> PruneReport:
    """One pass of retention over every table, each in batches of `limit` rows (default
    TELEMACHUS_PRUNE_BATCH), a table's batches repeated while they come back full and `more()`
    says go on (the worker's loop stops when asked to; the command never). After each batch it
    rests `pace` times as long as the batch took (the workers: TELEMACHUS_PRUNE_PACE), so a
    backlog takes a bounded share of the database's CPU beside the queue (docs/retention.md).
    Each batch is its own short transaction; call it outside any."""
    limit = limit or settings.TELEMACHUS_PRUNE_BATCH
    report = PruneReport()

    def drain(table: str, batch: Callable[[], int]) -> None:
        while more():
            began = time.monotonic()
            n = batch()
            report.add(table, n)
            if n < limit:
                return
            if pace > 0:
                time.sleep(pace * (time.monotonic() - began))

    now = timezone.now()
    for kept in retention_in_force():
        # Jobs first: no body is removed from a job about to be deleted.
        cutoff = _hours_ago(now, kept.hours)
        drain("jobs", partial(jobs_prune_batch, team_id=kept.team_id, cutoff=cutoff, limit=limit))
        if kept.body_hours is not None:
            body_cutoff = _hours_ago(now, kept.body_hours)
            remove = partial(bodies_remove_batch, team_id=kept.team_id, cutoff=body_cutoff, now=now, limit=limit)
            drain("bodies", remove)
            lines = partial(batch_bodies_remove_batch, team_id=kept.team_id, cutoff=body_cutoff, now=now, limit=limit)
            drain("batch bodies", lines)
        drain("batches", partial(batches_prune_batch, team_id=kept.team_id, cutoff=cutoff, limit=limit))
        drain("files", partial(files_prune_batch, team_id=kept.team_id, cutoff=cutoff, limit=limit))
    drain("usage", partial(usage_prune_batch, now=now, limit=limit))
    drain("audit", partial(audit_prune_batch, now=now, limit=limit))
    drain("webhook deliveries", partial(webhooks_prune_batch, now=now, limit=limit))
    drain("executor events", partial(executor_events_prune_batch, now=now, limit=limit))
    return report
