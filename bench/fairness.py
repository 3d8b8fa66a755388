"""Fairness of the default queue policy (FairSharePolicy) on PostgreSQL, with real worker processes
and the `sim` executor. Prints tables.

    .venv/bin/python bench/fairness.py [--parts 1,2,3,4] [--duration 60] [--warmup 10]
        [--trickle-jobs 60] [--trickle-pause 0.5] [--burst-after 30]
        [--burst-variants 1:300,0:300,10:300,1:10] [--samples 300]

Set-up, in a scratch database `telemachus_bench_fairness` on 127.0.0.1 (created and dropped): one
`sim` executor, a global ai.concurrency cap of 24 slots, two `scheduler_worker --concurrency 16`
processes (32 local slots, so the global cap is what binds), default policy settings unless a part
says otherwise. A flooding team's queue is bulk-loaded with 4,000 jobs and topped back up whenever
it falls below 2,000, checked every second, so it never runs dry (parts 1 and 2 print how low it
got).

  1. Weighted shares. Teams t1, t2, t3 with weights 1:2:3 all flood; sim latency 125 ± 75 ms
     (uniform 50-200 ms: a job holds its slot long enough for hold times to be measured in
     milliseconds, and the 24 slots turn over about 190 times a second). The first --warmup
     seconds after the first job starts are ignored; then, over --duration seconds, each team's
     share of the slot-time held in the window (each attempt's Job.started_at..finished_at,
     clipped to the window) against its target weight / sum of weights; Jain's index over the
     weight-normalised shares x = share / target, J = (sum x)^2 / (n sum x^2); and the largest
     |share - target| / target.
  2. Trickle beside flood. t1 floods; t2 (equal weight) submits one job at a time through
     job_submit, waits until it has started, pauses --trickle-pause seconds, --trickle-jobs times.
     Wait in claim cycles: how many claim transactions started jobs after the trickle job was
     queued and before the claim that started it (0: the first claim to start anything took it).
     Claims are serialized by the claim lock and write their events under it, so JobEvent ids
     order them against the job's `queued` event; a claim is told apart by its `started` events'
     (worker, at), one `at` per claim transaction. Also the wait in ms, two ways: the database
     stamps (started_at - submitted_at), and as the submitter sees it (from job_submit's return
     to the first poll that finds the job started).
  3. Burst. t1 and t2 flood with 1.5 s ± 0.5 s jobs for --burst-after seconds; then t3 (equal
     weight, idle so far) queues 1,000 jobs in one transaction. No job lasts under a second, so a
     start in the first second after the commit is a slot taken and kept through it, and about
     two thirds of the 24 slots free up in that second (room to take more than a fair share).
     Counted: t3's starts in that first second (and everyone's), and the slots t3 holds at +5 s,
     against its fair share of the slots (24 / 3 = 8; aim: at most 9), with each team's fair-share
     key, term by term, just before the burst and one second after it. Once per --burst-variants
     entry (entry_penalty:half_life_seconds).
  4. Claim latency with 10 teams: p50/p99 of job_claim(worker=..., limit=1) called in-process,
     each followed by job_finish so slots free up, with 1k and 100k jobs queued, spread evenly over
     10 teams (no workers running), in two submission orders: interleaved (round robin over the
     teams, as bench/throughput.py queues) and in blocks (each team's jobs submitted together, so
     each team's queue is one contiguous range of ids). With the plan of the claim's head-of-line
     lookup (EXPLAIN ANALYZE of one more claim's query): its time, the rows its filters threw
     away, and the indexes it used.
"""

import argparse
import bisect
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import django
from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = "telemachus_bench_fairness"

# Django is configured for the scratch database before any model is imported; the worker processes
# inherit the same environment.
os.environ.update(DATABASE_URL=pg_url(PG_BENCH_DB), DJANGO_SETTINGS_MODULE="telemachus.settings", LOG_LEVEL="WARNING")
sys.path.insert(0, str(ROOT))
django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.contrib.auth.models import AbstractBaseUser  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.models import Count  # noqa: E402
from django.utils import timezone  # noqa: E402

from executors.models import Executor  # noqa: E402
from quotas.models import QuotaPolicy  # noqa: E402
from scheduler.core.configuration import queue_policy  # noqa: E402
from scheduler.core.policy import FairSharePolicy, team_usage  # noqa: E402
from scheduler.models import Job, JobEvent, QueuePolicy, Slot, TeamShare  # noqa: E402
from scheduler.services.claim import job_claim  # noqa: E402
from scheduler.services.finish import job_finish  # noqa: E402
from scheduler.services.policy import queue_policy_update  # noqa: E402
from scheduler.services.submit import job_submit  # noqa: E402
from telemachus.control import notify  # noqa: E402
from telemachus.models import Team  # noqa: E402
from telemachus.teams.services import team_create, team_member_set  # noqa: E402

SLOTS = 24
WORKERS = 2
WORKER_CONCURRENCY = 16
MODEL = "sim"
FLOOD_QUEUED = 4_000
FLOOD_LOW_WATER = 2_000
SHORT_JOBS = {"latency_ms": 125, "jitter_ms": 75, "output_tokens": 16}
LONG_JOBS = {"latency_ms": 1500, "jitter_ms": 500, "output_tokens": 16}
WEIGHTS = (1, 2, 3)
BURST_JOBS = 1_000
BURST_OBSERVE = 5.0
TRICKLE_LEAD_IN = 5.0
TRICKLE_POLL = 0.005
INPUT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 16}


@dataclass(frozen=True)
class Member:
    """A team and its one user (who submits the team's jobs)."""

    user: AbstractBaseUser
    team: Team


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


# --- the scratch database and its contents --------------------------------------------------------


def db_now() -> datetime:
    """The database's clock, which stamps started_at and finished_at (same host as this process)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def seed() -> None:
    """The sim executor (offering only MODEL) and the global slot cap."""
    Executor.objects.create(
        name="sim", kind="sim", capabilities={"models": [MODEL]}, max_concurrency=1_000, meta=SHORT_JOBS
    )
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=SLOTS)


def members(n: int) -> list[Member]:
    """Teams t1..tn, each with one member, created as first needed: every team in the database adds
    a lookup to each claim, so a part runs with no more teams than it uses."""
    found = []
    for i in range(1, n + 1):
        slug = f"t{i}"
        team = Team.objects.filter(slug=slug).first()
        if team is None:
            get_user_model().objects.create_user(slug)
            team = team_create(slug=slug, name=slug)
            team_member_set(team=team, username=slug, role="member")
        found.append(Member(user=get_user_model().objects.get(username=slug), team=team))
    return found


def configure(
    *,
    job_meta: dict,
    team_weights: dict[str, float] | None = None,
    entry_penalty: float | None = None,
    half_life: float | None = None,
) -> None:
    """Sim latency for the part, and the policy fields it varies (the model's defaults otherwise)."""
    Executor.objects.filter(name="sim").update(meta=job_meta)
    defaults = {name: QueuePolicy._meta.get_field(name).default for name in ("entry_penalty", "half_life_seconds")}
    queue_policy_update(
        by=None,
        changes={
            "team_weights": team_weights or {},
            "entry_penalty": defaults["entry_penalty"] if entry_penalty is None else entry_penalty,
            "half_life_seconds": defaults["half_life_seconds"] if half_life is None else half_life,
        },
    )


def reset() -> None:
    """Empty the slots, the audit log, the jobs and the fair-share usage (no worker running). A
    TRUNCATE, not a DELETE: each part starts from an empty table, not one padded with the dead
    rows of the last, which would change the sizes (and so the plans) the planner sees."""
    tables = ", ".join(model._meta.db_table for model in (Slot, JobEvent, Job, TeamShare))
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {tables}")


def queue_jobs(counts: list[tuple[Member, int]], *, interleaved: bool = False) -> None:
    """Bulk-queue jobs in one transaction and wake the workers on commit: each team's jobs
    together, or round robin over the teams."""
    if interleaved:
        owners = [m for i in range(max(n for _, n in counts)) for m, n in counts if i < n]
    else:
        owners = [m for m, n in counts for _ in range(n)]
    now = timezone.now()
    rows = [
        Job(
            type="chat",
            user=m.user,
            team=m.team,
            requirements={"model": MODEL},
            model=MODEL,
            input=INPUT,
            submitted_at=now,
        )
        for m in owners
    ]
    with transaction.atomic():
        Job.objects.bulk_create(rows, batch_size=5_000)
        notify.notify_workers(notify.QUEUED)


def analyze() -> None:
    # What autovacuum does within a minute of a bulk load; without fresh statistics the planner
    # may pick a plan for an empty table.
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE scheduler_job")


def top_up(flooding: list[Member]) -> int:
    """Refill each flooding team whose queue fell below the low-water mark; return the smallest
    queue depth seen before refilling."""
    depth = dict(
        Job.objects.filter(status=Job.Status.QUEUED, team__in=[m.team for m in flooding])
        .order_by()
        .values_list("team")
        .annotate(n=Count("id"))
    )
    depths = {m: depth.get(m.team.pk, 0) for m in flooding}
    refill = [(m, FLOOD_QUEUED - d) for m, d in depths.items() if d < FLOOD_LOW_WATER]
    if refill:
        queue_jobs(refill)
    return min(depths.values())


def keep_flooding(flooding: list[Member], *, until: datetime) -> int:
    """Top the flooding teams up every second until the database clock reaches `until`; return the
    smallest queue depth seen."""
    lowest = top_up(flooding)
    while (left := (until - db_now()).total_seconds()) > 0:
        time.sleep(min(left, 1.0))
        lowest = min(lowest, top_up(flooding))
    return lowest


# --- worker processes -----------------------------------------------------------------------------


def start_workers() -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "scheduler_worker",
                "--concurrency",
                str(WORKER_CONCURRENCY),
                "--name",
                f"bench-{i}",
            ],
            cwd=ROOT,
            env=os.environ,
        )
        for i in range(WORKERS)
    ]


def stop_workers(procs: list[subprocess.Popen]) -> None:
    """SIGTERM drains: the workers stop claiming and finish what they hold, so every job that
    started has its finished_at."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=120)


def first_start(timeout: float = 60.0) -> datetime:
    """When the first job started (the workers are up and claiming)."""
    deadline = time.monotonic() + timeout
    while (
        started := Job.objects.exclude(started_at=None)
        .order_by("started_at")
        .values_list("started_at", flat=True)
        .first()
    ) is None:
        if time.monotonic() > deadline:
            raise SystemExit("no job started: did the workers come up?")
        time.sleep(0.1)
    return started


def slot_seconds(start: datetime, end: datetime, team: Team | None = None) -> Counter:
    """Slot-seconds each team held in [start, end): every attempt's started_at..finished_at,
    clipped to the window (jobs run once here: the sim executor does not fail)."""
    jobs = Job.objects.filter(started_at__lt=end, finished_at__gt=start)
    if team is not None:
        jobs = jobs.filter(team=team)
    held: Counter = Counter()
    for team_id, started, finished in jobs.values_list("team_id", "started_at", "finished_at"):
        held[team_id] += (min(finished, end) - max(started, start)).total_seconds()
    return held


def slots_held(team: Team, at: datetime) -> int:
    return Job.objects.filter(team=team, started_at__lte=at, finished_at__gt=at).count()


# --- 1. weighted shares ---------------------------------------------------------------------------


def weighted_shares(*, warmup: float, duration: float) -> dict:
    teams = members(len(WEIGHTS))
    configure(job_meta=SHORT_JOBS, team_weights={m.team.slug: w for m, w in zip(teams, WEIGHTS, strict=True)})
    reset()
    queue_jobs([(m, FLOOD_QUEUED) for m in teams])
    analyze()
    procs = start_workers()
    try:
        start = first_start() + timedelta(seconds=warmup)
        end = start + timedelta(seconds=duration)
        lowest = keep_flooding(teams, until=end)
    finally:
        stop_workers(procs)
    held = slot_seconds(start, end)
    total = sum(held.values())
    rows = []
    for m, weight in zip(teams, WEIGHTS, strict=True):
        target, share = weight / sum(WEIGHTS), held[m.team.pk] / total
        rows.append(
            {
                "team": m.team.slug,
                "weight": weight,
                "slot_s": held[m.team.pk],
                "target": target,
                "share": share,
                "x": share / target,
                "deviation": abs(share - target) / target,
            }
        )
    return {
        "rows": rows,
        "jain": jain([r["x"] for r in rows]),
        "max_deviation": max(r["deviation"] for r in rows),
        "utilisation": total / (SLOTS * duration),
        "lowest_queue": lowest,
        "jobs": Job.objects.filter(started_at__gte=start, started_at__lt=end).count(),
    }


# --- 2. trickle beside flood ----------------------------------------------------------------------


def trickle(*, jobs: int, pause: float) -> dict:
    flood, lone = members(2)
    configure(job_meta=SHORT_JOBS)
    reset()
    queue_jobs([(flood, FLOOD_QUEUED)])
    analyze()
    procs = start_workers()
    observed_ms: dict[int, float] = {}
    committed: dict[int, datetime] = {}  # the database clock just after job_submit returned
    submit_ms = []
    try:
        lowest = keep_flooding([flood], until=first_start() + timedelta(seconds=TRICKLE_LEAD_IN))
        began = db_now()
        for _ in range(jobs):
            called = time.monotonic()
            job = job_submit(
                user=lone.user, team=lone.team.slug, type="chat", requirements={"model": MODEL}, input=INPUT
            )
            returned = time.monotonic()
            committed[job.pk] = db_now()
            while not Job.objects.filter(pk=job.pk).exclude(started_at=None).exists():
                if time.monotonic() - returned > 30:
                    raise SystemExit(f"trickle job {job.pk} did not start within 30 s")
                time.sleep(TRICKLE_POLL)
            observed_ms[job.pk] = (time.monotonic() - returned) * 1000
            submit_ms.append((returned - called) * 1000)
            lowest = min(lowest, top_up([flood]))
            time.sleep(pause)
        ended = db_now()
    finally:
        stop_workers(procs)
    stamps = {
        pk: (queued, started)
        for pk, queued, started in Job.objects.filter(pk__in=observed_ms).values_list(
            "pk", "submitted_at", "started_at"
        )
    }
    stamped_ms = [(started - queued).total_seconds() * 1000 for queued, started in stamps.values()]
    waited = claims_waited(list(observed_ms))
    cycles = [len(claims) for claims in waited.values()]
    flood_held = slot_seconds(began, ended, team=flood.team)[flood.team.pk]
    return {
        "jobs": len(observed_ms),
        "cycles": Counter(cycles),
        "cycles_p50": percentile(cycles, 0.5),
        "cycles_p95": percentile(cycles, 0.95),
        "cycles_max": max(cycles),
        # Counted claims that asked for the claim lock (`at`) before job_submit had returned: they
        # may have read the queue before the job was committed, so could not have taken it.
        "counted": sum(cycles),
        "under_way": sum(at < committed[pk] for pk, claims in waited.items() for _, at in claims),
        "stamped": stamped_ms,
        "observed": list(observed_ms.values()),
        "submit_p50": percentile(submit_ms, 0.5),
        "started_before_submitted": sum(ms < 0 for ms in stamped_ms),
        "seconds": (ended - began).total_seconds(),
        "flood_utilisation": flood_held / (SLOTS * (ended - began).total_seconds()),
        "lowest_queue": lowest,
        "claims_per_s": claim_rate(began, ended),
    }


def claims_waited(job_ids: list[int]) -> dict[int, set[tuple[str, datetime]]]:
    """For each job, the claims that started other jobs after its `queued` event was written and
    before the claim that started it (ordered by event id; a claim is its started events'
    (worker, at))."""
    started = list(
        JobEvent.objects.filter(event=JobEvent.Type.STARTED)
        .order_by("id")
        .values_list("id", "job_id", "meta__worker", "at")
    )
    ids = [row[0] for row in started]
    claim_of = {job_id: (worker, at) for _, job_id, worker, at in started}
    start_event = {job_id: event_id for event_id, job_id, _, _ in started}
    queued_event = dict(
        JobEvent.objects.filter(event=JobEvent.Type.QUEUED, job_id__in=job_ids).values_list("job_id", "id")
    )
    waited = {}
    for job_id in job_ids:
        low = bisect.bisect_right(ids, queued_event[job_id])
        high = bisect.bisect_left(ids, start_event[job_id])
        waited[job_id] = {(worker, at) for _, _, worker, at in started[low:high]} - {claim_of[job_id]}
    return waited


def claim_rate(start: datetime, end: datetime) -> float:
    """Claims that started jobs, per second, in [start, end)."""
    claims = (
        JobEvent.objects.filter(event=JobEvent.Type.STARTED, at__gte=start, at__lt=end)
        .order_by()
        .values_list("meta__worker", "at")
        .distinct()
        .count()
    )
    return claims / (end - start).total_seconds()


# --- 3. burst -------------------------------------------------------------------------------------


def burst(*, penalty: float, half_life: float, busy_for: float) -> dict:
    teams = members(3)
    busy, newcomer = teams[:2], teams[2]
    configure(job_meta=LONG_JOBS, entry_penalty=penalty, half_life=half_life)
    reset()
    queue_jobs([(m, FLOOD_QUEUED) for m in busy])
    analyze()
    procs = start_workers()
    try:
        keep_flooding(busy, until=first_start() + timedelta(seconds=busy_for))
        before = key_terms(teams)
        queue_jobs([(newcomer, BURST_JOBS)])
        burst_at = db_now()
        one_second = burst_at + timedelta(seconds=1)
        keep_flooding(busy, until=one_second)
        after = key_terms(teams)
        keep_flooding(busy, until=burst_at + timedelta(seconds=BURST_OBSERVE))
    finally:
        stop_workers(procs)
    return {
        "penalty": penalty,
        "half_life": half_life,
        "fair": SLOTS / len(teams),
        "starts_1s": Job.objects.filter(team=newcomer.team, started_at__lt=one_second).count(),
        "all_starts_1s": Job.objects.filter(started_at__gte=burst_at, started_at__lt=one_second).count(),
        "held_5s": slots_held(newcomer.team, burst_at + timedelta(seconds=BURST_OBSERVE)),
        "before": before,
        "after": after,
    }


def key_terms(teams: list[Member]) -> list[dict]:
    """Each team's fair-share key as the policy computes it for its next job, term by term: slots
    running, next job's cost (1), decayed usage / half-life, and the key."""
    record = queue_policy()
    policy = FairSharePolicy(record)
    now = db_now()
    running = Counter(dict(Slot.objects.order_by().values_list("team_id").annotate(n=Count("id"))))
    usage = team_usage(team_ids=[m.team.pk for m in teams], now=now, half_life=record.half_life_seconds)
    rows = []
    for m in teams:
        weight = record.weight(m.team.slug)
        rows.append(
            {
                "team": m.team.slug,
                "running": running[m.team.pk],
                "usage_term": usage.get(m.team.pk, 0.0) / record.half_life_seconds / weight,
                "key": policy.share_key(
                    running=running[m.team.pk], next_cost=1, usage=usage.get(m.team.pk, 0.0), weight=weight
                ),
            }
        )
    return rows


# --- 4. claim latency with 10 teams ---------------------------------------------------------------


def claim_latency(*, depth: int, interleaved: bool, samples: int) -> dict:
    teams = members(10)
    configure(job_meta=SHORT_JOBS)
    reset()
    queue_jobs([(m, depth // len(teams)) for m in teams], interleaved=interleaved)
    analyze()
    timings = []
    for _ in range(samples):
        started = time.perf_counter()
        (claim,) = job_claim(worker="bench", limit=1).claims
        timings.append((time.perf_counter() - started) * 1000)
        job_finish(job_id=claim.job.pk, lease=claim.lease, result={})
    return {"p50": percentile(timings, 0.5), "p99": percentile(timings, 0.99), **heads_plan()}


def heads_plan() -> dict:
    """How the database ran the claim's per-team head-of-line lookup (one UNION ALL, captured from
    one more claim): EXPLAIN ANALYZE's execution time, rows read and thrown away by filters, and
    which index served the subqueries."""
    captured = []

    def capture(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict) -> Any:
        if " UNION ALL " in sql:
            captured.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(capture):
        (claim,) = job_claim(worker="bench", limit=1).claims
    job_finish(job_id=claim.job.pk, lease=claim.lease, result={})
    sql, params = captured[0]
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        (plan,) = cursor.fetchone()
    plan = (json.loads(plan) if isinstance(plan, str) else plan)[0]
    indexes: Counter = Counter()
    filtered, nodes = 0, [plan["Plan"]]
    while nodes:
        node = nodes.pop()
        if "Index Name" in node:
            indexes[node["Index Name"]] += 1
        filtered += node.get("Rows Removed by Filter", 0)
        nodes.extend(node.get("Plans", []))
    return {"lookup_ms": plan["Execution Time"], "filtered": filtered, "indexes": dict(indexes)}


# --- the run and the tables -----------------------------------------------------------------------


def print_shares(r: dict, *, warmup: float, duration: float) -> None:
    print(
        f"\n1. weighted shares: weights 1:2:3, {SLOTS} slots, sim 50-200 ms; {duration:.0f} s window "
        f"after {warmup:.0f} s warm-up; {r['jobs']} jobs started in it\n"
    )
    print(f"{'team':<6} {'weight':>6} {'slot-s':>8} {'target':>7} {'share':>7} {'share/target':>13} {'deviation':>10}")
    for row in r["rows"]:
        print(
            f"{row['team']:<6} {row['weight']:>6} {row['slot_s']:>8.1f} {row['target']:>7.3f} {row['share']:>7.3f} "
            f"{row['x']:>13.3f} {row['deviation']:>9.1%}"
        )
    print(
        f"Jain's index {r['jain']:.4f} (aim >= 0.99); largest deviation {r['max_deviation']:.1%} (aim <= 10%); "
        f"slot utilisation {r['utilisation']:.1%}; lowest queue seen {r['lowest_queue']}"
    )


def print_trickle(r: dict, *, pause: float) -> None:
    print(
        f"\n2. trickle beside flood: t1 floods, t2 submits {r['jobs']} jobs one at a time ({pause} s apart) "
        f"over {r['seconds']:.0f} s; sim 50-200 ms\n"
    )
    print(f"{'wait':<46} {'p50':>8} {'p95':>8} {'max':>8}")
    print(f"{'claim cycles':<46} {r['cycles_p50']:>8} {r['cycles_p95']:>8} {r['cycles_max']:>8}   (aim: p95 <= 2)")
    for label, key in (
        ("ms, started_at - submitted_at", "stamped"),
        (f"ms, submit returned -> seen started ({TRICKLE_POLL * 1000:.0f} ms polls)", "observed"),
    ):
        values = r[key]
        print(f"{label:<46} {percentile(values, 0.5):>8.1f} {percentile(values, 0.95):>8.1f} {max(values):>8.1f}")
    print("claim cycles waited: trickle jobs = " + ", ".join(f"{c}: {n}" for c, n in sorted(r["cycles"].items())))
    print(
        f"claims counted {r['counted']}, of which {r['under_way']} had asked for the claim lock before job_submit "
        f"returned; started_at < submitted_at for {r['started_before_submitted']} of {r['jobs']} jobs"
    )
    print(
        f"flood held {r['flood_utilisation']:.1%} of the slots; {r['claims_per_s']:.0f} job-starting claims/s; "
        f"lowest flood queue seen {r['lowest_queue']}; job_submit took {r['submit_p50']:.1f} ms (p50)"
    )


def print_burst(results: list[dict], *, busy_for: float) -> None:
    fair = results[0]["fair"]
    print(
        f"\n3. burst: t1, t2 flood (sim 1-2 s) for {busy_for:.0f} s, then t3 queues {BURST_JOBS} jobs at once; "
        f"equal weights, fair share {fair:.0f} of {SLOTS} slots (aim: t3 starts in the 1st s <= {fair + 1:.0f})\n"
    )
    print(
        f"{'entry_penalty':>13} {'half-life s':>11} {'t3 starts in 1st s':>19} {'all starts in 1st s':>20} "
        f"{'t3 slots at +5 s':>17}"
    )
    for r in results:
        print(
            f"{r['penalty']:>13g} {r['half_life']:>11g} {r['starts_1s']:>19} {r['all_starts_1s']:>20} "
            f"{r['held_5s']:>17}"
        )
    for r in results:
        print(
            f"\nentry_penalty {r['penalty']:g}, half-life {r['half_life']:g} s: "
            f"key = (running + next job 1 + usage/half-life) / weight"
        )
        print(f"{'':<6} {'just before the burst':>29}   {'1 s after':>29}")
        print(
            f"{'team':<6} {'running':>8} {'usage term':>11} {'key':>8}   {'running':>8} {'usage term':>11} {'key':>8}"
        )
        for b, a in zip(r["before"], r["after"], strict=True):
            print(
                f"{b['team']:<6} {b['running']:>8} {b['usage_term']:>11.2f} {b['key']:>8.2f}   "
                f"{a['running']:>8} {a['usage_term']:>11.2f} {a['key']:>8.2f}"
            )


def print_latency(latency: dict[tuple[str, int], dict]) -> None:
    print("\n4. claim latency, job_claim(limit=1) in-process, each followed by job_finish; 10 teams\n")
    print(
        f"{'order':<12} {'queued':>8} {'p50 ms':>8} {'p99 ms':>8} {'lookup ms':>10} {'rows filtered':>14}   "
        "indexes of the lookup's subqueries (EXPLAIN ANALYZE of one more claim)"
    )
    for (order, depth), r in latency.items():
        indexes = ", ".join(f"{name} {n}" for name, n in sorted(r["indexes"].items()))
        print(
            f"{order:<12} {depth:>8} {r['p50']:>8.2f} {r['p99']:>8.2f} {r['lookup_ms']:>10.2f} "
            f"{r['filtered']:>14}   {indexes}"
        )
    for order in dict.fromkeys(order for order, _ in latency):
        depths = sorted(depth for o, depth in latency if o == order)
        small, big = latency[order, depths[0]], latency[order, depths[-1]]
        print(
            f"{order}: {depths[-1]} / {depths[0]} queued: p50 {big['p50'] / small['p50']:.2f}x, "
            f"p99 {big['p99'] / small['p99']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run (default all)")
    parser.add_argument("--duration", type=float, default=60, help="part 1: measured window, seconds")
    parser.add_argument("--warmup", type=float, default=10, help="part 1: seconds ignored after the first start")
    parser.add_argument("--trickle-jobs", type=int, default=60, help="part 2: jobs the trickle team submits")
    parser.add_argument("--trickle-pause", type=float, default=0.5, help="part 2: seconds between them")
    parser.add_argument("--burst-after", type=float, default=30, help="part 3: seconds the busy teams run first")
    parser.add_argument(
        "--burst-variants",
        default="1:300,0:300,10:300,1:10",
        help="part 3: entry_penalty:half_life_seconds pairs, one run each (1:300: the defaults)",
    )
    parser.add_argument("--samples", type=int, default=300, help="part 4: timed claims per queue depth")
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}

    pg_database(PG_BENCH_DB, "create")
    try:
        call_command("migrate", verbosity=0)
        seed()
        if 1 in parts:
            print_shares(
                weighted_shares(warmup=args.warmup, duration=args.duration), warmup=args.warmup, duration=args.duration
            )
        if 2 in parts:
            print_trickle(trickle(jobs=args.trickle_jobs, pause=args.trickle_pause), pause=args.trickle_pause)
        if 3 in parts:
            variants = [tuple(map(float, v.split(":"))) for v in args.burst_variants.split(",")]
            print_burst(
                [
                    burst(penalty=penalty, half_life=half_life, busy_for=args.burst_after)
                    for penalty, half_life in variants
                ],
                busy_for=args.burst_after,
            )
        if 4 in parts:
            print_latency(
                {
                    (order, depth): claim_latency(depth=depth, interleaved=order == "interleaved", samples=args.samples)
                    for order in ("interleaved", "blocks")
                    for depth in (1_000, 100_000)
                }
            )
    finally:
        connection.close()
        pg_database(PG_BENCH_DB, "drop")


if __name__ == "__main__":
    main()
