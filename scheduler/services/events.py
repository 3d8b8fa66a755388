"""The only writer of JobEvent rows. Callers pass the time of the change (usually the database
clock read under their lock) so an event's `at` matches the transition it records.

Every event of a job also tells the API processes watching it (waits, streams, the OpenAI-compatible
endpoint) that it changed, at commit: jobs change state only through services that record an
event in the same transaction, so this one place covers every transition. A job's first event
(`queued`, from submit) tells nobody: no one can be watching a job before its id is returned."""

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.utils import timezone

from executors.health import ExecutorEvent
from executors.models import Executor
from scheduler.models import Job, JobEvent
from telemachus.control import notify
from telemachus.db.bulk import children_insert_statement, insert_statement, rows_insert
from telemachus.db.statements import NO_RIDERS, Riders, Statement, riding_supported


def job_event(
    *, job: Job | None, event: str, at: datetime | None = None, executor: Executor | int | None = None, **meta: Any
) -> JobEvent:
    """An unsaved event, for callers that write several at once with `events_record`."""
    executor_id = executor.pk if isinstance(executor, Executor) else executor
    return JobEvent(job=job, event=event, at=at or timezone.now(), executor_id=executor_id, meta=meta)


def events_record(events: Iterable[JobEvent]) -> None:
    """Write events in one multi-row INSERT (one array per column on PostgreSQL, its SQL built
    once: telemachus/db/bulk.py), and tell API processes watching the jobs (none for `queued`
    events: nobody watches a job before its submit returns) from that same statement: a round
    trip fewer on every finish. The notice still leaves at commit, as any NOTIFY in a
    transaction."""
    events = list(events)
    rows_insert(JobEvent, events, riders=notify.job_watchers_riders(_watched(events)))


def events_riders(events: Sequence[JobEvent]) -> Riders:
    """`events` written, and their watchers told, as riders of another statement the caller
    sends, which must return a row for each row it writes (telemachus/db/statements.py): a round
    trip fewer than `events_record` (the claim's events ride on its slots' INSERT; the finish's
    on its jobs' end UPDATE). Where nothing can ride (SQLite) they are written after it. Their
    ids are not read back."""
    if not events:
        return NO_RIDERS
    told = notify.job_watchers_riders(_watched(events))
    return Riders(
        writes=[insert_statement(JobEvent, events)] if riding_supported() else [],
        notices=told.notices,
        instead=lambda: events_record(events),
    )


def submitted_events(children: Sequence[tuple[int, JobEvent]]) -> Statement:
    """The events of jobs that the submit's statement inserts (scheduler/core/statements.py),
    each with the position of its job among them: their `job` is set from the new ids. No notice:
    nobody watches a job before its submit returns."""
    return children_insert_statement(JobEvent, children, parent="job", source="inserted")


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
