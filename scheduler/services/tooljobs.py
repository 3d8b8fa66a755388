"""Tool jobs: `{"type": "tool", "input": {"tool": "echo", "arguments": {...}}}` runs one registered
tool (executors/tools.py) in a worker's tool threads.

A tool job needs no executor, so it takes no slot: the caps and fair share govern executors'
capacity, which a tool does not use. The claim starts queued tool jobs beside the jobs it places,
highest priority then first ready, in the worker capacity it has left; the worker's tool threads
(TELEMACHUS_TOOL_THREADS) bound how many run at once. Leases, heartbeats, cancel, recovery and
the finish are a job's like any other."""

import uuid
from datetime import datetime

from scheduler.core.locks import lock_tool_jobs_queued
from scheduler.models import Job, JobEvent
from scheduler.services.events import events_record, job_event
from telemachus.db.changes import rows_save


def tool_jobs_start(*, worker: str, limit: int, now: datetime, expires: datetime) -> list[Job]:
    """Mark up to `limit` queued tool jobs running for `worker`, under one new lease token, with
    a `started` event each; returns them (with their input). Runs inside the claim's transaction.
    Locks the job rows with SKIP LOCKED (level 3), so it never waits on a row: a job being
    canceled is skipped, and a second batch of job rows after the claim's cannot deadlock."""
    if limit <= 0:
        return []
    jobs = lock_tool_jobs_queued(now=now, limit=limit)
    if not jobs:
        return []
    lease = uuid.uuid4()
    for job in jobs:
        job.start(executor=None, worker=worker, lease=lease, expires=expires, now=now)
    rows_save(jobs)
    events_record(
        job_event(job=job, event=JobEvent.Type.STARTED, at=now, worker=worker, tool=job.input.get("tool"))
        for job in jobs
    )
    return jobs
