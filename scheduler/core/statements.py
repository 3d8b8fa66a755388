"""The scheduler's hand-written SQL: the two statements the ORM cannot build at the speed they run.

Everything else the scheduler sends is built by the ORM (compiled once where it is hot:
telemachus/db/compiled.py) or by the database package's builders from the models' own fields
(telemachus/db/bulk.py, changes.py); tests/test_raw_sql.py fails when SQL is written anywhere else.
These two are the exceptions, and why:

  the queue's heads   each team's first few queued jobs, one indexed lookup per team, all in one
                      UNION ALL. The ORM can say it on PostgreSQL (`union` of sliced querysets),
                      but compiling it took 2.2 ms per claim (measured in-process; the claim's
                      whole database work is under 1 ms), and it cannot be compiled once: LIMIT
                      is a literal, so every team count, model list and batch size is a new
                      shape; SQLite refuses LIMIT inside a compound statement altogether.
  the submit          admission in one round trip (PostgreSQL): lock the teams' rows and their
                      queue tally rows, confirm the configuration version, insert the jobs only if
                      each team's queue has room, insert their events, wake the workers. The
                      same guard runs on SQLite (no data-modifying CTEs there, and no round trips
                      to save), followed by the inserts in the same transaction. The depth rule
                      (`queued <= room`) is written once, here, for both.
"""

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection

from scheduler.models import Job
from telemachus.control import notify
from telemachus.db.bulk import insert_statement
from telemachus.db.locks import Level, for_update_sql
from telemachus.db.statements import Statement
from telemachus.models import ConfigVersion, Team

# SQLite allows at most 500 terms in a compound SELECT.
LOOKUPS_PER_STATEMENT = 200

TALLY = "scheduler_queue_tally"


def queued_heads_statements(
    *,
    columns: str,
    wanted: dict[int, tuple[set[str], int]],
    exclude_users: set[int],
    now: datetime,
    aged_before: datetime | None,
) -> list[Statement]:
    """The lookups of scheduler/core/selectors.py `queued_heads_sent`: for each team id in
    `wanted`, up to n of its queued jobs for the given models (`columns` of them), highest priority
    then first ready, skipping users at their cap and retries still waiting out their backoff;
    with `aged_before`, also those of its n longest waiting that entered the queue by then. The
    status is a literal, so both backends can use the partial indexes (job_team_ready_idx,
    job_team_wait_idx), and each lookup asks for at least two rows: at LIMIT 1 PostgreSQL may walk
    the primary key instead of the team's index."""
    qn = connection.ops.quote_name
    table = qn(Job._meta.db_table)
    stamp = connection.ops.adapt_datetimefield_value
    lookups: list[tuple[str, list[Any]]] = []
    for team_id, (models, n) in wanted.items():
        if not models or n <= 0:
            continue
        where = [
            f"{qn('team_id')} = %s",
            f"{qn('status')} = '{Job.Status.QUEUED.value}'",
            f"{qn('model')} IN ({', '.join(['%s'] * len(models))})",
            f"({qn('run_after')} IS NULL OR {qn('run_after')} <= %s)",
        ]
        params: list[Any] = [team_id, *sorted(models), stamp(now)]
        if exclude_users:
            where.append(f"{qn('user_id')} NOT IN ({', '.join(['%s'] * len(exclude_users))})")
            params += sorted(exclude_users)
        condition = " AND ".join(where)
        lookups.append(
            (
                f"SELECT {columns} FROM {table} WHERE {condition} "
                f"ORDER BY {qn('priority')} DESC, {qn('ready_at')}, {qn('id')} LIMIT %s",
                [*params, max(n, 2)],
            )
        )
        if aged_before is not None:
            # The n longest waiting, then those of them that have aged: filtering inside the lookup
            # would walk a whole deep queue whenever nothing has aged yet.
            lookups.append(
                (
                    f"SELECT * FROM (SELECT {columns} FROM {table} WHERE {condition} "
                    f"ORDER BY {qn('queued_at')}, {qn('id')} LIMIT %s) AS oldest WHERE {qn('queued_at')} <= %s",
                    [*params, max(n, 2), stamp(aged_before)],
                )
            )
    statements = []
    for start in range(0, len(lookups), LOOKUPS_PER_STATEMENT):
        chunk = lookups[start : start + LOOKUPS_PER_STATEMENT]
        sql = " UNION ALL ".join(f"SELECT * FROM ({part}) AS head{i}" for i, (part, _) in enumerate(chunk))
        statements.append(Statement(sql, [param for _, params in chunk for param in params]))
    return statements


# --- the submit ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    """What the submit's statement found: whether it wrote the jobs (their ids, in order), and
    otherwise why not: the configuration version and each team's queue depth as it read them."""

    ok: bool
    version: int
    depths: dict[int, int]
    ids: list[int]


def _depth(pending: bool) -> str:
    """A team's queue depth from its tally rows (scheduler/migrations/0015_queue_tally.py, 0018):
    on PostgreSQL the tally is written at commit, so a transaction adds what it changed and has
    not applied yet (`pending`); SQLite's triggers write it at once."""
    if connection.vendor == "postgresql" and pending:
        return "i.n - o.n + scheduler_queue_noted(i.team_id, 'in') - scheduler_queue_noted(i.team_id, 'out')"
    return "i.n - o.n"


def submit_guard(*, rooms: Sequence[tuple[int, int]], version: int, pending: bool) -> Statement:
    """The admission's guard, as CTEs `w`, `depth` and `go`: lock each team's row (level 0), then
    its `in` tally row (level 6, the last), in ascending team order (`rooms` is sorted), reading
    each at its latest (a row another transaction changed is read again); `go.ok` when the
    configuration version is `version`, every team has its tally, and each team's queue holds no
    more than its room (the cap less the jobs of this submit) — the depth rule, once."""
    return Statement(
        _guard_sql(len(rooms), pending, connection.vendor),
        [*(value for pair_ in rooms for value in pair_), version, len(rooms)],
    )


@functools.cache
def _guard_sql(teams: int, pending: bool, vendor: str) -> str:
    """The guard's SQL for `teams` teams, built once per shape: a one-by-one submit would
    otherwise spend a twentieth of its Python time writing the same text again."""
    qn = connection.ops.quote_name
    pair = "(%s::bigint, %s::bigint)" if vendor == "postgresql" else "(%s, %s)"
    lock = for_update_sql(level=Level.CONFIGURATION, of="t, i")  # level 0, then the tally (level 6)
    return (
        f"WITH w(team_id, room) AS (VALUES {', '.join([pair] * teams)}), "
        f"depth AS (SELECT t.id AS id, {_depth(pending)} AS queued, w.room AS room FROM w "
        f"JOIN {qn(Team._meta.db_table)} t ON t.id = w.team_id "
        f"JOIN {TALLY} i ON i.team_id = t.id AND i.side = 'in' "
        f"JOIN {TALLY} o ON o.team_id = t.id AND o.side = 'out' ORDER BY t.id{lock}), "
        f"version AS (SELECT coalesce((SELECT {qn('version')} FROM {qn(ConfigVersion._meta.db_table)} "
        f"WHERE id = {ConfigVersion.SINGLETON_ID}), 0) AS n), "
        "go AS (SELECT (SELECT n FROM version) AS version, (SELECT n FROM version) = %s AND count(*) = %s "
        "AND coalesce(min(CASE WHEN queued <= room THEN 1 ELSE 0 END), 0) = 1 AS ok FROM depth)"
    )


def submit_statement(*, guard: Statement, jobs: Sequence[Job], events: Statement, wake: bool) -> Statement:
    """PostgreSQL: the whole submit in one statement, which commits by itself outside a
    transaction: the guard, the jobs inserted only if it says ok, their events (`events`, from
    scheduler/services/events.py, reading the new ids from the CTE `inserted` in insert order),
    the workers' wake-up only if something was inserted. Returns one row: ok, version, the teams
    and their depths (sorted by team), the new ids in order."""
    jobs_insert = insert_statement(Job, jobs, returning=True)
    wakeup = (
        f"CASE WHEN (SELECT ok FROM go) THEN pg_notify('{notify.WORKERS_CHANNEL}', '{notify.QUEUED}') END"
        if wake
        else "NULL"
    )
    sql = (
        f"{guard.sql}, "
        f"inserted AS ({_guarded(jobs_insert.sql)}), "
        f"recorded AS ({events.sql}) "
        "SELECT (SELECT ok FROM go), (SELECT version FROM go), ARRAY(SELECT id FROM depth ORDER BY id), "
        f"ARRAY(SELECT queued FROM depth ORDER BY id), {wakeup}, ARRAY(SELECT id FROM inserted ORDER BY id)"
    )
    return Statement(sql, [*guard.params, *jobs_insert.params, *events.params])


def _guarded(insert_sql: str) -> str:
    """The jobs' INSERT ... SELECT ... FROM UNNEST(...) made to insert only when the guard says ok."""
    head, returning = insert_sql.rsplit(" RETURNING ", 1)
    return f"{head} WHERE (SELECT ok FROM go) RETURNING {returning}"


def submit_admitted(row: Sequence[Any]) -> Admitted:
    """The submit statement's row, read."""
    ok, version, teams, depths, _, ids = row
    return Admitted(ok=bool(ok), version=version or 0, depths=dict(zip(teams, depths, strict=True)), ids=list(ids))


def guard_checked(guard: Statement) -> Admitted:
    """SQLite (and any database without data-modifying CTEs): run the guard alone, inside the
    caller's transaction, which holds the database's write lock; the caller inserts when ok."""
    rows = Statement(
        f"{guard.sql} SELECT go.ok, go.version, depth.id, depth.queued FROM go LEFT JOIN depth ON 1 = 1",
        guard.params,
    ).rows()
    ok, version = rows[0][0], rows[0][1]
    depths = {team: queued for _, _, team, queued in rows if team is not None}
    return Admitted(ok=bool(ok), version=version or 0, depths=depths, ids=[])
