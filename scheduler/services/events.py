"""The only writer of JobEvent rows. Callers pass the time of the change (usually the database
clock read under their lock) so an event's `at` matches the transition it records.

Every event of a job also tells the API processes watching it (waits, streams, the OpenAI-compatible
endpoint) that it changed, at commit: jobs change state only through services that record an
event in the same transaction, so this one place covers every transition. A job's first event
(`queued`, from submit) tells nobody: no one can be watching a job before its id is returned."""

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.db import connection
from django.utils import timezone

from executors.health import ExecutorEvent
from executors.models import Executor
from scheduler.core.bulk import insert_statement, rows_insert
from scheduler.models import Job, JobEvent
from telemachus.control import notify


def job_event(
    *, job: Job | None, event: str, at: datetime | None = None, executor: Executor | int | None = None, **meta: Any
) -> JobEvent:
    """An unsaved event, for callers that write several at once with `events_record`."""
    executor_id = executor.pk if isinstance(executor, Executor) else executor
    return JobEvent(job=job, event=event, at=at or timezone.now(), executor_id=executor_id, meta=meta)


def events_record(events: Iterable[JobEvent]) -> None:
    """Write events in one multi-row INSERT (one array per column on PostgreSQL, its SQL built
    once: scheduler/core/bulk.py), and tell API processes watching the jobs (none for `queued`
    events: nobody watches a job before its submit returns) from that same statement: a round
    trip fewer on every finish. The notice still leaves at commit, as any NOTIFY in a
    transaction."""
    events = list(events)
    with notify.job_watchers_told(_watched(events)):
        rows_insert(JobEvent, events)


@contextmanager
def events_riding(events: Sequence[JobEvent]) -> Iterator[None]:
    """Write `events`, and tell their watchers, within the first statement the block runs, which
    must return a row for each row it writes (an INSERT or UPDATE with RETURNING): on PostgreSQL
    the events' INSERT rides along as a CTE of that statement, a round trip fewer than
    `events_record` (the claim's, on its slots' INSERT; the finish's, on its jobs' end UPDATE);
    elsewhere they are written after the block. Their ids are
    not read back."""
    if connection.vendor != "postgresql" or not events:
        yield
        events_record(events)
        return
    with notify.job_watchers_told(_watched(events), riders=[insert_statement(JobEvent, events)]):
        yield


def _watched(events: Sequence[JobEvent]) -> list[tuple[int, str]]:
    return [
        (event.job_id, event.event)
        for event in events
        if event.job_id is not None and event.event != JobEvent.Type.QUEUED
    ]


def event_record(
    *, job: Job | None, event: str, at: datetime | None = None, executor: Executor | int | None = None, **meta: Any
) -> JobEvent:
    created = job_event(job=job, event=event, at=at, executor=executor, **meta)
    events_record([created])
    return created


def job_step_record(*, job_id: int, executor_id: int | None, **meta: Any) -> JobEvent:
    """A `step` event that a driver reported during a dispatch (`ExecutorDriver.report_step`: a
    batch system's job id, say). Not fenced by the lease: it records what the executor was asked to
    do, which stays true when the dispatch is later aborted. One INSERT; may run in autocommit."""
    return event_record(job=Job(pk=job_id), event=JobEvent.Type.STEP, executor=executor_id, **meta)


def executor_events_record(events: Sequence[ExecutorEvent]) -> None:
    """Executor health's recorder (executors/health.py): its events are job-less JobEvent rows."""
    events_record(job_event(job=None, event=e.event, at=e.at, executor=e.executor_id, **e.meta) for e in events)
