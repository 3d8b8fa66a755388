"""Every row lock of the project is taken through this module, in one global order. A
transaction may skip a level but never take an earlier one after a later one: two code paths
that disagree on order are how deadlocks happen.

    0. configuration rows an operator's write or a submit starts from: team rows in ascending id
       (a submit's admission counts each team's queue under its row; team deletes and membership
       writes), feature switch rows, an API key's row (its revoke, which then cancels the key's
       queued jobs: level 3).
    1. the claim lock: the QueuePolicy singleton row. Every transaction that creates slots (claim,
       acquire) takes it first, so slot creation is serialized cluster-wide and the in-use counts a
       claim reads cannot change under it except downwards (finish, cancel and recovery only
       delete slots, and never take this lock).
    2. executor rows, in ascending id (breaker and probe updates; the claim's move of a breaker to
       half open).
    3. job rows, in ascending id.
    4. usage ledger rows (quotas.Usage), in key order, then spend ledger rows (quotas.Spend), in
       key order: taken by the upserts that apply a settlement (quotas/budget.py), not by a SELECT;
       then job tally rows (scheduler.JobTally), by retention's upsert after the job rows it
       deleted. Retention deletes ledger windows that ended, SKIP LOCKED, locking nothing else.
    5. team share rows (scheduler.TeamShare), in ascending team id: taken by the upsert that
       charges fair share (scheduler/services/shares.py).
    6. queue tally rows (scheduler_queue_tally, PostgreSQL), in ascending (team, side): by the
       submit after its team rows, and by triggers, at commit for a job that leaves or re-enters
       the queue (scheduler/migrations/0015_queue_tally.py); nothing is locked after them.
    7. webhook delivery rows (telemachus.WebhookDelivery), SKIP LOCKED, by the delivery loop alone,
       in a transaction that locks nothing else (telemachus/webhooks/delivery.py). The changes that
       cause a delivery insert its row, which locks nothing anyone waits for. Retention deletes
       deliveries that ended, SKIP LOCKED, in a transaction that locks nothing else.
    8. rows only retention deletes (audit events, executor events), SKIP LOCKED, in a
       transaction that locks nothing else (scheduler/services/retention.py).

Configuration writes (executors, teams, memberships, permissions, quota rules, the policy,
feature switches) also update the configuration version row (telemachus.ConfigVersion), by
trigger, and hold it to commit, so configuration writes serialize on it. The claim's move of a
breaker to half open is one: it takes the row after the claim lock and an executor row, and
nothing else is locked after it that another configuration writer could hold.

Finish, cancel, release and recovery lock job rows only (then ledger and share rows); breaker
updates from their outcomes run in a transaction of their own afterwards (executors/health.py).
On SQLite, `select_for_update` is a no-op and every transaction starts with BEGIN IMMEDIATE (see
settings), which serializes writers for the whole database.

Callers order the rows they lock by primary key (or key order) within a level. The scheduler's
own lock helpers (the claim lock, job rows) are in scheduler/core/locks.py, built on this module.
"""

from collections.abc import Sequence
from enum import IntEnum
from typing import TypeVar

from django.db import connection
from django.db.models import Model, QuerySet
from django.db.models.manager import BaseManager

M = TypeVar("M", bound=Model)


class Level(IntEnum):
    CONFIGURATION = 0
    CLAIM = 1
    EXECUTOR = 2
    JOB = 3
    USAGE = 4
    SHARE = 5
    TALLY = 6
    WEBHOOK_DELIVERY = 7
    RETAINED = 8


def rows_lock(
    rows: "QuerySet[M] | BaseManager[M]",
    *,
    level: Level,
    skip_locked: bool = False,
    of: Sequence[str] = (),
    no_key: bool = False,
) -> "QuerySet[M]":
    """`rows` locking them FOR UPDATE (SKIP LOCKED when the caller would rather pass a row
    another transaction holds than wait for it; FOR NO KEY UPDATE with `no_key`, for a write that
    changes no key, so inserts of rows that reference it are not held up). `level` names the row's
    place in the order above: the call site says which lock it takes, and every lock of the
    project is found from here."""
    return rows.all().select_for_update(skip_locked=skip_locked, of=tuple(of), no_key=no_key)


def for_update_sql(*, level: Level, of: str, skip_locked: bool = False) -> str:
    """The locking clause for a statement written in SQL (the claim's hot path), on PostgreSQL;
    empty where the database has no row locks (SQLite serializes writers instead)."""
    if not connection.features.has_select_for_update:
        return ""
    return f" FOR UPDATE OF {of}" + (" SKIP LOCKED" if skip_locked else "")


def lock_sql(*, level: Level) -> str:
    """The locking clause of a plain SELECT on one row (the claim lock), empty where the database
    has no row locks."""
    return " FOR UPDATE" if connection.features.has_select_for_update else ""
