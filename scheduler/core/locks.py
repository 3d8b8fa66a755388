"""The scheduler's row locks: the claim lock and job rows, taken in the project's one global lock
order (telemachus/db/locks.py, which says why and what comes before and after each level)."""

import copy
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypedDict

from django.db import connection
from django.db.models import Exists, Func, OuterRef, Q, QuerySet, Subquery, TextField, Value
from django.db.models.functions import Now

from executors.models import Executor
from quotas.concurrency import SlotCounts
from scheduler.core.configuration import policy_record
from scheduler.core.selectors import slot_counts_sent, stored_policy
from scheduler.models import Job, QueuePolicy
from telemachus.control.config import config_at, version_annotation
from telemachus.db.compiled import CompiledQuery
from telemachus.db.constants import Constant
from telemachus.db.locks import Level, rows_lock
from telemachus.db.pipeline import together


class Clocked(TypedDict):
    """What `lock_job` annotates a job with: the database clock, read with the lock."""

    db_now: datetime


class Versioned(Clocked):
    """What `lock_jobs_to_finish` adds: the configuration version, read with the lock."""

    config_version: int


class Finishing(Versioned):
    """What `lock_jobs_to_finish` adds: the failures its executor's breaker has counted."""

    executor_failures: int | None


if TYPE_CHECKING:
    from django_stubs_ext import WithAnnotations

    ClockedJob = WithAnnotations[Job, Clocked]
    VersionedJob = WithAnnotations[Job, Versioned]
    FinishedJob = WithAnnotations[Job, Finishing]


def lock_claim(
    *, as_stored: bool = False, commit_unflushed: bool = False, counts: bool = False
) -> tuple[QueuePolicy, datetime]:
    """Lock the claim lock, then read the database clock, with what costs nothing more in the same
    statement: the configuration version (`policy.config_version`, scheduler/core/configuration.py) and
    when the next retry's backoff ends (`policy.next_retry`, job_retry_idx) and whether any tool job
    is queued (`policy.tools_queued`, job_tool_queue_idx: the claim skips looking for them when
    none is, a lookup that cost about a sixth of a claim), the earliest queue deadline
    (`policy.next_deadline`, job_queue_deadline_idx) and whether a job on a model route is queued
    (`policy.routed_queued`, job_routed_idx). The policy returned
    is a copy of the record as of that version (the configuration cache), so it is the row as it
    stands: any change to it moves the version, and a change cannot commit while the lock is held.
    It comes back as the scheduler may use it (scheduler/core/bounds.py: an out-of-bounds stored
    value is replaced, never trusted); `as_stored` reads the row as it is, for its editor.
    `commit_unflushed` (the claim's): on PostgreSQL the same statement sets `synchronous_commit`
    off for this transaction, so its commit does not wait for the WAL flush (why that is safe for
    a claim: docs/gateway.md, "The claim's commit"). `counts` (the claim's): the slots held per
    scope, read with the lock (`policy.slot_counts`, scheduler/core/selectors.py).

    Must run inside a transaction. The time is the database's, so leases do not depend on the
    worker hosts' clocks agreeing, and it is read once the lock is held: a statement's timestamp is
    taken when it starts, so one read with the locking SELECT would be early by the time spent
    waiting for the lock (stamping starts, leases and events before the job could start). Each
    statement is compiled once (telemachus/db/compiled.py): this runs first in every claim, under
    the lock every claim waits for; on PostgreSQL the lock, the clock and the counts go in one
    round trip (telemachus/db/pipeline.py)."""
    clock = _CLOCK_UNFLUSHED if commit_unflushed and connection.vendor == "postgresql" else _CLOCK

    def send() -> tuple[Callable[[], list[Any]], Callable[[], list[Any]], Callable[[], SlotCounts | None]]:
        with together():
            return _CLAIM_LOCK.sent(), clock.sent(), (slot_counts_sent() if counts else _no_counts)

    locked, clocked, slots = send()
    if not locked():
        # The data migration creates the row; a flushed test database or a manual delete may
        # not have it. Creating it concurrently is harmless: one insert wins, the other is
        # ignored. The rest is read again: it was read without the lock.
        clocked(), slots()
        QueuePolicy.objects.bulk_create([QueuePolicy(pk=QueuePolicy.SINGLETON_ID)], ignore_conflicts=True)
        locked, clocked, slots = send()
        locked()
    now, version, next_retry, tools_queued, next_deadline, routed_queued, *_ = clocked()[0]
    found = slots()
    if as_stored:
        policy = stored_policy()
    else:
        policy = copy.copy(policy_record(config_at(version)))  # queue_policy(): bounds applied
    policy.config_version, policy.next_retry, policy.tools_queued = version or 0, next_retry, bool(tools_queued)
    policy.next_deadline, policy.routed_queued = next_deadline, bool(routed_queued)
    if found is not None:
        policy.slot_counts = found
    return policy, now


def _no_counts() -> None:
    return None


def _clock(*, unflushed: bool) -> "QuerySet[Any]":
    """The clock's statement: the database's time, the configuration version, the next retry's
    end, whether a tool job waits, the earliest queue deadline, whether a routed job waits;
    `unflushed` adds SET LOCAL
    synchronous_commit = off as a column (PostgreSQL: no round trip of its own)."""
    # Each read is of a partial index whose predicate names these constants: in the statement's
    # text, not parameters, so the prepared statement keeps one plan (telemachus/db/constants.py).
    queued = Job.objects.filter(status=Constant(Job.Status.QUEUED))
    columns: dict[str, Any] = {
        "db_now": Now(),
        "version": version_annotation(),
        "next_retry": Subquery(queued.filter(run_after__gt=Now()).order_by("run_after").values("run_after")[:1]),
        "tools": Exists(queued.filter(type=Constant(Job.Type.TOOL))),
        "next_deadline": Subquery(
            queued.filter(queue_deadline__isnull=False).order_by("queue_deadline").values("queue_deadline")[:1]
        ),
        "routed": Exists(queued.exclude(route=Constant(""))),
    }
    if unflushed:
        columns["unflushed"] = Func(
            Value("synchronous_commit"), Value("off"), Value(True), function="set_config", output_field=TextField()
        )
    return QueuePolicy.objects.filter(pk=QueuePolicy.SINGLETON_ID).annotate(**columns).values_list(*columns)


_CLAIM_LOCK: CompiledQuery[tuple[int]] = CompiledQuery(
    lambda: rows_lock(QueuePolicy.objects.filter(pk=QueuePolicy.SINGLETON_ID), level=Level.CLAIM).values_list("pk")
)
_CLOCK: CompiledQuery[tuple[Any, ...]] = CompiledQuery(lambda: _clock(unflushed=False))
_CLOCK_UNFLUSHED: CompiledQuery[tuple[Any, ...]] = CompiledQuery(lambda: _clock(unflushed=True))


def lock_job(job_id: int) -> "ClockedJob | None":
    """Lock one job row (level 3); None when it does not exist. Must run inside a transaction."""
    return rows_lock(Job.objects.annotate(db_now=Now()).filter(pk=job_id), level=Level.JOB).first()


def lock_jobs(job_ids: Sequence[int]) -> "list[ClockedJob]":
    """Lock job rows (level 3) in ascending id, with the database clock. Must run inside a
    transaction."""
    return list(
        rows_lock(Job.objects, level=Level.JOB).filter(pk__in=sorted(job_ids)).annotate(db_now=Now()).order_by("pk")
    )


def lock_jobs_versioned(job_ids: Sequence[int]) -> "list[VersionedJob]":
    """Lock whole job rows (level 3) in ascending id, with the database clock and the configuration
    version read in the same statement (flows' round ends, which read the conversation and price
    by the cached configuration). Must run inside a transaction."""
    return list(
        rows_lock(Job.objects, level=Level.JOB, of=("self",))
        .filter(pk__in=sorted(job_ids))
        .annotate(db_now=Now(), config_version=version_annotation())
        .order_by("pk")
    )


def lock_jobs_to_finish(job_ids: Sequence[int]) -> "list[FinishedJob]":
    """Lock job rows (level 3) in ascending id, for the finish of a batch: with the database clock
    and the configuration version read in the same statement, the failures its executor's breaker
    has counted (read, not locked: executor rows are never locked with job rows), and only the
    columns a finish reads (the batch's hot path: its SQL is compiled once per batch size,
    telemachus/db/compiled.py). Must run inside a transaction."""
    return _JOBS_TO_FINISH(ids=sorted(job_ids))


FINISH_READS = (
    "pk",
    "status",
    "lease",
    "lease_expires_at",
    "executor_id",
    "tokens_used",
    "worker",
    "attempts",
    "team_id",
    "user_id",
    "reservation",
    "started_at",
    "cost_estimate",
    # What an attempt's cost is priced and recorded by (scheduler/services/attempts.py).
    "model",
    "key_id",
    "cost",
    # A route's models: a job that failed after its retries moves to the next (issue #39).
    "route_models",
    # A batch's line pays the model's batch price (executors/prices.py).
    "batch_id",
)


_JOBS_TO_FINISH: "CompiledQuery[FinishedJob]" = CompiledQuery(
    lambda ids: (
        rows_lock(Job.objects, level=Level.JOB, of=("self",))
        .filter(pk__in=ids)
        .annotate(
            db_now=Now(),
            config_version=version_annotation(),
            executor_failures=Subquery(
                Executor.objects.filter(pk=OuterRef("executor_id")).values("consecutive_failures")[:1]
            ),
        )
        .order_by("pk")
        .only(*FINISH_READS)
    )
)


def lock_jobs_held(held: Q, *, exclude: Sequence[str] = ("input", "conversation")) -> "list[ClockedJob]":
    """Lock the running jobs that `held` matches (their holder's (id, lease) pairs), level 3, in
    ascending id, with the database clock: a worker giving its jobs back. Must run inside a
    transaction."""
    return list(
        rows_lock(Job.objects, level=Level.JOB)
        .filter(held, status=Job.Status.RUNNING)
        .annotate(db_now=Now())
        .order_by("pk")
        .defer(*exclude)
    )


def lock_jobs_expired(*, limit: int) -> "list[ClockedJob]":
    """Lock up to `limit` running jobs whose lease has expired by the database's clock (level 3),
    in ascending id, skipping rows another recoverer holds (SKIP LOCKED): recovery is safe to run
    from every worker at once. Must run inside a transaction."""
    return list(
        rows_lock(Job.objects, level=Level.JOB, skip_locked=True)
        .filter(status=Job.Status.RUNNING, lease_expires_at__lte=Now())
        .annotate(db_now=Now())
        .order_by("pk")
        .defer("input", "conversation")[:limit]
    )


def lock_tool_jobs_queued(*, now: datetime, limit: int) -> list[Job]:
    """Lock up to `limit` queued tool jobs whose backoff is over (level 3), highest priority then
    first ready, skipping rows another transaction holds (a job being canceled, another claim's)
    so the claim never waits on a row. Must run inside the claim's transaction."""
    return list(
        rows_lock(Job.objects, level=Level.JOB, skip_locked=True)
        .filter(Q(run_after__isnull=True) | Q(run_after__lte=now), status=Job.Status.QUEUED, type=Job.Type.TOOL)
        .order_by("-priority", "ready_at", "id")[:limit]
    )
