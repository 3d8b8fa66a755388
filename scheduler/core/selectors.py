"""Reads that the claim and the services share. Writes live in scheduler/services/."""

from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import Any

from django.db import connection
from django.db.models import BigIntegerField, Count, F, Func, OuterRef, Subquery

from quotas.concurrency import SlotCounts
from scheduler.core.statements import queued_heads_statements
from scheduler.models import Job, QueuePolicy, QueueTally, Slot
from telemachus.db.compiled import CompiledQuery
from telemachus.db.pipeline import sent
from telemachus.db.rows import RowMapper
from telemachus.models import Membership, Team
from telemachus.teams import rbac

# The payload columns: the claim reads many more heads than it takes, so these are left out of
# the lookups (deferred: a policy that reads them still gets them, one query per job) and the
# claim reads them only for the jobs it takes. A prompt can be far bigger than the rest of a row.
PAYLOAD_FIELDS = ("input", "result", "error", "conversation")
HEAD_FIELDS = tuple(f.name for f in Job._meta.concrete_fields if f.name not in PAYLOAD_FIELDS)


def stored_policy() -> QueuePolicy:
    """The policy record as it is stored (its editor's view: out-of-bounds values and all), or
    an unsaved default when there is no row. Everyone else reads `queue_policy`
    (scheduler/core/configuration.py), the record as the scheduler may use it."""
    return QueuePolicy.objects.filter(pk=QueuePolicy.SINGLETON_ID).first() or QueuePolicy()


def queue_depths(*, team_ids: Collection[int] | None = None) -> dict[int, int]:
    """Each team's queue depth (its jobs queued now), from the queue tally (QueueTally): the one
    way the depth is read, by admission, the metrics, the dashboard and its history. Teams with
    no tally row (none: every team gets two) are left out. On PostgreSQL the tally is written at
    commit: a reader inside a transaction that moved jobs adds what it has not applied yet, as the
    submit's guard does (scheduler/migrations/0015_queue_tally.py)."""
    rows = QueueTally.objects.all() if team_ids is None else QueueTally.objects.filter(team_id__in=team_ids)
    counted: Any = F("n")
    if connection.vendor == "postgresql" and not connection.get_autocommit():
        counted += Func(F("team_id"), F("side"), function="scheduler_queue_noted", output_field=BigIntegerField())
    depths: dict[int, int] = {}
    for team_id, side, n in rows.values_list("team_id", "side", counted):
        depths[team_id] = depths.get(team_id, 0) + (n if side == "in" else -n)
    return depths


def jobs_running() -> dict[int, int]:
    """Each team's running jobs (teams with none left out)."""
    running = Job.objects.filter(status=Job.Status.RUNNING).order_by().values_list("team_id").annotate(n=Count("id"))
    return dict(running)


def queued_by_priority() -> dict[tuple[int, int], int]:
    """How each team's queue splits across priorities, (team id, priority) -> jobs (the metrics'
    labels): a count over the queued jobs (job_team_ready_idx), which the tally does not keep."""
    queued = (
        Job.objects.filter(status=Job.Status.QUEUED)
        .order_by()
        .values_list("team_id", "priority")
        .annotate(n=Count("id"))
    )
    return {(team_id, priority): n for team_id, priority, n in queued}


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
    job not yet aged can never outrank the head by priority). Each team's jobs come back
    unsorted, without their payload (PAYLOAD_FIELDS: deferred, so a policy that reads them still
    gets them, one query per job).

    Indexed lookups per team, so rows examined grow with the number of teams and the batch size,
    not with the depth of any queue; all of them travel as one UNION ALL, written by hand
    (scheduler/core/statements.py says why). Executed now, read when the result is called: inside
    telemachus.db.pipeline.together() the lookups go with the block's other statements (the claim
    reads the teams' fair-share usage with them)."""
    mapper = RowMapper.of_fields(Job, HEAD_FIELDS)
    statements = queued_heads_statements(
        columns=", ".join(mapper.columns), wanted=wanted, exclude_users=exclude_users, now=now, aged_before=aged_before
    )
    reads = [sent(statement.sql, statement.params, mapper.instances) for statement in statements]

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


def slot_counts_sent() -> Callable[[], SlotCounts]:
    """`slot_counts`, executed now and read when the result is called (the claim sends it with its
    lock: scheduler/core/locks.py)."""
    read = _SLOT_COUNTS.sent()
    return lambda: _counts(read())


def slot_counts() -> SlotCounts:
    """Slots held right now, per scope, from one grouped query over the Slot table."""
    return slot_counts_sent()()


_SLOT_COUNTS: CompiledQuery[Any] = CompiledQuery(
    lambda: Slot.objects.order_by().values_list("executor_id", "team_id", "user_id", "batch").annotate(n=Count("*"))
)


def _counts(grouped: Sequence[tuple[int, int, int, bool, int]]) -> SlotCounts:
    counts = SlotCounts()
    total = 0
    for executor_id, team_id, user_id, batch, n in grouped:
        counts.executor[executor_id] += n
        counts.team[team_id] += n
        counts.user[user_id] += n
        if batch:
            counts.batch[executor_id] += n
        total += n
    return SlotCounts(total=total, executor=counts.executor, team=counts.team, user=counts.user, batch=counts.batch)


def oldest_finished() -> dict[int, datetime]:
    """When each team's oldest kept finished job ended, in one query whatever the number of teams:
    per team, two correlated reads of one row each through retention's two indexes
    (job_ended_idx, job_stripped_idx), the earlier of the two kept. No lock."""
    ended = Job.objects.filter(team=OuterRef("pk"), status__in=Job.TERMINAL, body_removed_at__isnull=True)
    stripped = Job.objects.filter(team=OuterRef("pk"), body_removed_at__isnull=False)
    found: dict[int, datetime] = {}
    rows = Team.objects.order_by().annotate(
        ended=Subquery(ended.order_by("finished_at").values("finished_at")[:1]),
        stripped=Subquery(stripped.order_by("finished_at").values("finished_at")[:1]),
    )
    for team_id, *ends in rows.values_list("pk", "ended", "stripped"):
        kept = [end for end in ends if end is not None]
        if kept:
            found[team_id] = min(kept)
    return found
