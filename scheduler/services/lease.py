import uuid
from collections.abc import Mapping
from functools import reduce
from operator import or_

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from scheduler.core.configuration import queue_policy
from scheduler.core.locks import lock_jobs_held
from scheduler.models import Job, JobEvent
from scheduler.services.attempts import AttemptEnd, attempts_end
from scheduler.services.claim import lease_length
from scheduler.services.events import events_riders, job_event
from telemachus.control import notify
from telemachus.db.changes import rows_save


def held_by(held: Mapping[int, uuid.UUID]) -> Q:
    """Jobs matching (id, lease) pairs: the fencing condition, grouped by lease token."""
    by_lease: dict[uuid.UUID, list[int]] = {}
    for job_id, lease in held.items():
        by_lease.setdefault(lease, []).append(job_id)
    return reduce(or_, (Q(lease=lease, pk__in=ids) for lease, ids in by_lease.items()))


def leases_renew(*, held: Mapping[int, uuid.UUID]) -> set[int]:
    """Heartbeat: extend the leases of the jobs a worker holds (job id -> lease), by the database's
    clock; return the ids still held.

    A job missing from the answer is lost (lease expired, recovered or canceled): its holder must
    abort the dispatch, because the job may already be running elsewhere. An expired lease is never
    revived, even before recovery has run."""
    if not held:
        return set()
    with transaction.atomic():
        live = Job.objects.filter(held_by(held), status=Job.Status.RUNNING, lease_expires_at__gt=Now())
        live.update(lease_expires_at=Now() + lease_length())
        return set(Job.objects.filter(held_by(held), lease_expires_at__gt=Now()).values_list("pk", flat=True))


def jobs_release(*, held: Mapping[int, uuid.UUID], reason: str) -> list[int]:
    """Give running jobs back to the queue unfinished (a worker shutting down before they ended).

    The attempt is given back too: the job did not fail. Frees their slots; records `requeued`.
    Locks the job rows (level 3). Only the holder can release: a job whose lease is no longer the
    one named is left alone."""
    if not held:
        return []
    with transaction.atomic(durable=True):
        jobs = lock_jobs_held(held_by(held))
        if not jobs:
            return []
        ends = [AttemptEnd.of(job, tokens=None, charge=False) for job in jobs]
        events = []
        for job in jobs:
            events.append(
                job_event(job=job, event=JobEvent.Type.REQUEUED, at=job.db_now, reason=reason, worker=job.worker)
            )
            job.return_to_queue(attempt_counts=False)
        rows_save(jobs, riders=events_riders(events))
        notify.notify_workers(notify.QUEUED)
        attempts_end(ends=ends, now=jobs[0].db_now, record=queue_policy(), wake=True)
    return [job.pk for job in jobs]
