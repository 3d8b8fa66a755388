"""Every row lock in the scheduler is taken here, in one global order:

    1. the claim lock: the QueuePolicy singleton row. Every transaction that creates slots
       (claim, acquire) takes it first, so slot creation is serialized cluster-wide and the
       in-use counts a claim reads cannot change under it except downwards (finish, cancel and
       recovery only delete slots, and never take this lock).
    2. executor rows, in ascending id (breaker and probe updates; the claim's move of a breaker
       to half open).
    3. job rows, in ascending id.
    4. usage ledger rows (quotas.Usage), in key order (quotas/budget.py).
    5. team share rows (scheduler.TeamShare), in ascending team id (services/shares.py).

Finish, cancel, release and recovery lock job rows only; breaker updates from their outcomes run
in a transaction of their own afterwards (executors/health.py), never inside one holding jobs.

A transaction may skip a level but never take them out of order: two code paths that disagree on
order are how deadlocks happen. On SQLite, `select_for_update` is a no-op and every transaction
starts with BEGIN IMMEDIATE (see settings), which serializes writers for the whole database.
"""

from datetime import datetime

from django.db.models.functions import Now

from scheduler.models import Job, QueuePolicy
from scheduler.policy_bounds import policy_in_force


def lock_claim(*, as_stored: bool = False) -> tuple[QueuePolicy, datetime]:
    """Lock the claim lock, and read the policy and then the database clock.

    The policy comes back as the scheduler may use it (scheduler/policy_bounds.py: an out-of-bounds
    stored value is replaced, never trusted); `as_stored` returns the row as it is, for its editor.

    Must run inside a transaction. The time is the database's, so leases do not depend on the
    worker hosts' clocks agreeing, and it is read once the lock is held: a statement's timestamp is
    taken when it starts, so one read with the locking SELECT would be early by the time spent
    waiting for the lock (stamping starts, leases and events before the job could start)."""
    query = QueuePolicy.objects.select_for_update()
    policy = query.filter(pk=QueuePolicy.SINGLETON_ID).first()
    if policy is None:
        # The data migration creates the row; a flushed test database or a manual delete may not
        # have it. Creating it concurrently is harmless: one insert wins, the other is ignored.
        QueuePolicy.objects.bulk_create([QueuePolicy(pk=QueuePolicy.SINGLETON_ID)], ignore_conflicts=True)
        policy = query.get(pk=QueuePolicy.SINGLETON_ID)
    now = QueuePolicy.objects.filter(pk=policy.pk).annotate(db_now=Now()).values_list("db_now", flat=True).get()
    return (policy if as_stored else policy_in_force(policy)), now


def lock_job(job_id: int) -> Job | None:
    """Lock one job row (level 3); None when it does not exist. Must run inside a transaction."""
    return Job.objects.select_for_update().annotate(db_now=Now()).filter(pk=job_id).first()
