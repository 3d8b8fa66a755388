"""Reads that the claim and the services share. Writes live in scheduler/services/."""

import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models.sql.compiler import SQLCompiler

from quotas.concurrency import SlotCounts
from scheduler.core.bounds import policy_in_force
from scheduler.models import Job, QueuePolicy, Slot
from telemachus.models import Membership
from telemachus.pipeline import sent
from telemachus.teams import rbac

# SQLite allows at most 500 terms in a compound SELECT.
LOOKUPS_PER_STATEMENT = 200
# The payload columns: the claim reads many more heads than it takes, so these are left out of
# the lookups (deferred: a policy that reads them still gets them, one query per job) and the
# claim reads them only for the jobs it takes. A prompt can be far bigger than the rest of a row.
PAYLOAD_FIELDS = ("input", "result", "error", "conversation")


def queue_policy() -> QueuePolicy:
    """The policy record as it is now, without locking it (the claim reads it under its lock), as
    the scheduler may use it: out-of-bounds stored values replaced (scheduler/core/bounds.py)."""
    return policy_in_force(QueuePolicy.objects.filter(pk=QueuePolicy.SINGLETON_ID).first() or QueuePolicy())


def policy_seen_by(user: rbac.Principal, data: dict[str, Any]) -> dict[str, Any]:
    """What a user may see of the policy: operators all of it; others only the entries about their
    own teams, themselves and the roles, so no other team's slug or weight and no other user's
    name leaks (the rule everywhere else)."""
    if rbac.is_operator(user):
        return data
    slugs = set(rbac.visible_teams(user).values_list("slug", flat=True))
    mine = {*Membership.Role.values, *(f"team:{slug}" for slug in slugs), f"user:{user.get_username()}"}
    return {
        **data,
        "team_weights": {k: v for k, v in data["team_weights"].items() if k in slugs},
        "max_queue_depth": {k: v for k, v in data["max_queue_depth"].items() if k == "default" or k in slugs},
        "priority_map": {k: v for k, v in data["priority_map"].items() if k in mine},
    }


def queued_heads_sent(
    *,
    wanted: dict[int, tuple[set[str], int]],
    exclude_users: set[int],
    now: datetime,
    aged_before: datetime | None = None,
) -> Callable[[], dict[int, list[Job]]]:
    """The head of each team's line: for each team id in `wanted`, up to n of its queued jobs for
    the given models, highest priority then first ready (`ready_at`, then id), skipping users at
    their cap and retries still waiting out their backoff; with `aged_before`, also those of its n
    longest waiting that entered the queue by then (`queued_at`: aging may have lifted them, and a
    job not yet aged can never outrank the head by priority).
    Each team's jobs come back unsorted, without their payload (PAYLOAD_FIELDS).

    Indexed lookups per team (job_team_ready_idx, job_team_wait_idx), so rows examined grow with
    the number of teams and the batch size, not with the depth of any queue; all of them travel
    as one UNION ALL. Written as SQL rather than with the ORM: this runs in every claim, under
    the claim lock, and compiling two querysets per team cost more than the database's work. The
    status is a literal, so both backends can use the partial indexes, and each lookup asks for at
    least two rows: at LIMIT 1 PostgreSQL may walk the primary key instead of the team's index.

    Executed now, read when the result is called: inside telemachus.pipeline.together() the
    lookups go with the block's other statements (the claim reads the teams' fair-share usage with
    them)."""
    qn = connection.ops.quote_name
    heads_sql = _heads_row()
    columns = heads_sql.columns
    lookups: list[tuple[str, list]] = []
    for team_id, (models, n) in wanted.items():
        if not models or n <= 0:
            continue
        where = [
            f"{qn('team_id')} = %s",
            f"{qn('status')} = '{Job.Status.QUEUED.value}'",
            f"{qn('model')} IN ({', '.join(['%s'] * len(models))})",
            f"({qn('run_after')} IS NULL OR {qn('run_after')} <= %s)",
        ]
        params = [team_id, *sorted(models), connection.ops.adapt_datetimefield_value(now)]
        if exclude_users:
            where.append(f"{qn('user_id')} NOT IN ({', '.join(['%s'] * len(exclude_users))})")
            params += sorted(exclude_users)
        table = qn(Job._meta.db_table)
        lookups.append(
            (
                f"SELECT {columns} FROM {table} WHERE {' AND '.join(where)} "
                f"ORDER BY {qn('priority')} DESC, {qn('ready_at')}, {qn('id')} LIMIT %s",
                [*params, max(n, 2)],
            )
        )
        if aged_before is not None:
            # The n longest waiting, then those of them that have aged: filtering inside the lookup
            # would walk a whole deep queue whenever nothing has aged yet.
            lookups.append(
                (
                    f"SELECT * FROM (SELECT {columns} FROM {table} WHERE {' AND '.join(where)} "
                    f"ORDER BY {qn('queued_at')}, {qn('id')} LIMIT %s) AS oldest "
                    f"WHERE {qn('queued_at')} <= %s",
                    [*params, max(n, 2), connection.ops.adapt_datetimefield_value(aged_before)],
                )
            )
    reads = []
    for start in range(0, len(lookups), LOOKUPS_PER_STATEMENT):
        chunk = lookups[start : start + LOOKUPS_PER_STATEMENT]
        sql = " UNION ALL ".join(f"SELECT * FROM ({part}) AS head{i}" for i, (part, _) in enumerate(chunk))
        reads.append(heads_sql.jobs_sent(sql, [param for _, params in chunk for param in params]))

    def read() -> dict[int, list[Job]]:
        heads: dict[int, list[Job]] = {}
        seen: set[int] = set()
        for jobs in reads:
            for job in jobs():
                if job.pk not in seen:
                    seen.add(job.pk)
                    heads.setdefault(job.team_id, []).append(job)
        return heads

    return read


class _HeadsRow:
    """A head's columns (the job without its payload) and how a row of them becomes a Job, as
    the ORM makes it (its converters, the payload deferred), worked out once per database: read
    through `Job.objects.raw` each claim paid for that every time, about a third of the heads'
    read (measured in-process on PostgreSQL)."""

    def __init__(self) -> None:
        query = Job.objects.only(*(f.name for f in Job._meta.concrete_fields if f.name not in PAYLOAD_FIELDS)).query
        self.compiler: SQLCompiler = query.get_compiler(connection=connection)
        self.compiler.setup_query()
        targets = [column[0].target for column in self.compiler.select]
        qn = connection.ops.quote_name
        self.columns = ", ".join(qn(target.column) for target in targets)
        self.attnames = [target.attname for target in targets]
        self.converters = self.compiler.get_converters([column[0] for column in self.compiler.select])

    def jobs_sent(self, sql: str, params: list[Any]) -> Callable[[], list[Job]]:
        """Execute now, read when the result is called (telemachus/pipeline.py)."""
        return sent(sql, params, self._jobs)

    def _jobs(self, rows: Any) -> list[Job]:
        if self.converters:
            rows = self.compiler.apply_converters(rows, self.converters)
        return [Job.from_db(connection.alias, self.attnames, row) for row in rows]


# Per thread, as Django's connections are: the compiler keeps the connection it was made for.
_heads_rows = threading.local()


def _heads_row() -> _HeadsRow:
    found: _HeadsRow | None = getattr(_heads_rows, "row", None)
    if found is None:
        found = _heads_rows.row = _HeadsRow()
    return found


def slot_counts_sql() -> str:
    """The grouped query of `slot_counts` (plain SQL: it runs in every claim, under the claim
    lock, which sends it with the lock: scheduler/core/locks.py)."""
    qn = connection.ops.quote_name
    columns = ", ".join(qn(c) for c in ("executor_id", "team_id", "user_id"))
    return f"SELECT {columns}, COUNT(*) FROM {qn(Slot._meta.db_table)} GROUP BY {columns}"


def slot_counts(grouped: Sequence[tuple[int, int, int, int]] | None = None) -> SlotCounts:
    """Slots held right now, per scope, from one grouped query over the Slot table; `grouped`:
    that query's rows, read already."""
    if grouped is None:
        with connection.cursor() as cursor:
            cursor.execute(slot_counts_sql())
            grouped = cursor.fetchall()
    counts = SlotCounts()
    total = 0
    for executor_id, team_id, user_id, n in grouped:
        counts.executor[executor_id] += n
        counts.team[team_id] += n
        counts.user[user_id] += n
        total += n
    return SlotCounts(total=total, executor=counts.executor, team=counts.team, user=counts.user)
