"""The claim and the finish at database speed, step by step: each change of issue #12 measured
against what it replaced, A/B interleaved in one run. Prints a table.

    .venv/bin/python bench/steps.py [--rounds 20] [--batch 64] [--backends postgres,sqlite] [--drain 3000]

In-process, one connection, the seed of throughput.py (two teams, all four caps in force, fair
share on, DEBUG off): each round queues `--batch` jobs, claims them in one claim and finishes
them in one finish, timing each. For every step a round runs with the step as it is now (B) and
a round with what it replaced patched back in (A), alternating, so drift in the machine hits
both alike:

  configuration cache  A: every claim and finish reads executors, teams, quota rules (and the
                       users they name), executor grants and the queue policy again
                       (the cache is dropped before each call, which is what the code did)
  fair-share charge    A: SELECT ... FOR UPDATE of the share rows, then an UPDATE (and an INSERT
                       for a team's first charge); B: one INSERT ... ON CONFLICT DO UPDATE
  submit               A: job_submit with the configuration cache dropped before each call
                       (membership, permissions, executors, rules, policy read each time)

and, on PostgreSQL, with real worker processes (`--drain` no-op jobs, 2 workers at --concurrency
64, repeated and interleaved):

  finish thread        A: the worker's finishes and heartbeats on its claim thread (as before);
                       B: on a thread and connection of their own

PostgreSQL runs in a scratch database `telemachus_bench_steps` on 127.0.0.1 (created and dropped).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchlib import pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = "telemachus_bench_steps"
PRODUCTION_ENV = {
    "DJANGO_SETTINGS_MODULE": "telemachus.settings",
    "LOG_LEVEL": "WARNING",
    "DEBUG": "0",
    "SECRET_KEY": "bench-only-" + "x" * 50,
    "ALLOWED_HOSTS": "127.0.0.1",
}
STEPS = ("configuration cache", "fair-share charge")


# --- what each step replaced ----------------------------------------------------------------------


@contextmanager
def before(step: str):
    """Patch back in what `step` replaced."""
    from scheduler.services import attempts, claim

    patches: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if step == "fair-share charge":
        patch(claim, "team_shares_charge", _team_shares_charge_before)
        patch(attempts, "team_shares_charge", _team_shares_charge_before)
    try:
        yield
    finally:
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)


def _team_shares_charge_before(*, charges, now, half_life) -> None:
    from scheduler.models import TeamShare
    from telemachus.db.bulk import update_rows

    charges = {team_id: amount for team_id, amount in charges.items() if amount}
    if not charges:
        return
    locked = TeamShare.objects.select_for_update().filter(team_id__in=sorted(charges)).order_by("team_id")
    shares = list(locked)
    missing = set(charges) - {share.team_id for share in shares}
    if missing:
        TeamShare.objects.bulk_create(
            [TeamShare(team_id=team_id, usage=0.0, updated_at=now) for team_id in missing], ignore_conflicts=True
        )
        shares = list(locked.all())
    update_rows(
        TeamShare,
        [
            {
                "team": share.team_id,
                "usage": max(share.decayed(now, half_life) + charges[share.team_id], 0.0),
                "updated_at": max(now, share.updated_at),
            }
            for share in shares
        ],
        key="team",
    )


# --- child: one backend -------------------------------------------------------------------------


def child(database_url: str, rounds: int, batch: int, drain_jobs: int) -> dict:
    os.environ.update(DATABASE_URL=database_url, **PRODUCTION_ENV)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import django

    django.setup()
    import throughput
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    setup = throughput.seed()
    results = {step: claim_finish(step, setup, rounds=rounds, batch=batch) for step in STEPS}
    results["submit"] = submit_latency(setup, rounds=rounds, per_round=batch)
    if drain_jobs and database_url.startswith("postgres"):  # SQLite workers keep one thread
        results["finish thread"] = finish_thread(setup, database_url, jobs=drain_jobs, repeats=max(rounds // 5, 2))
    return results


def claim_finish(step: str, setup: dict, *, rounds: int, batch: int) -> dict:
    """Per variant: ms per claim of `batch` jobs and per finish of them (medians over rounds)."""
    import throughput

    from scheduler.services.claim import job_claim
    from scheduler.services.finish import Outcome, jobs_finish
    from telemachus.control.config import config_cache_clear

    uncached = step == "configuration cache"
    timings = {variant: {"claim": [], "finish": []} for variant in "AB"}
    throughput.clear()
    for i in range(2 * rounds + 2):
        variant = "AB"[i % 2]
        throughput.queue(batch, setup)
        with before(step) if variant == "A" else _nothing():
            if uncached and variant == "A":
                config_cache_clear()
            started = time.perf_counter()
            claims = job_claim(worker="bench", limit=batch).claims
            claimed = time.perf_counter()
            if uncached and variant == "A":
                config_cache_clear()
            outcomes = [Outcome(job_id=c.job.pk, lease=c.lease, ok=True, result={}, tokens_used=1) for c in claims]
            started_finish = time.perf_counter()
            jobs_finish(outcomes=outcomes, wake_others=False)
            finished = time.perf_counter()
        assert len(claims) == min(batch, 64), f"claimed {len(claims)}"
        if i >= 2:  # the first round of each warms caches and plans
            timings[variant]["claim"].append((claimed - started) * 1000)
            timings[variant]["finish"].append((finished - started_finish) * 1000)
    return {
        variant: {what: statistics.median(values) for what, values in parts.items()}
        for variant, parts in timings.items()
    }


def submit_latency(setup: dict, *, rounds: int, per_round: int) -> dict:
    """ms per job_submit, with the configuration cache (B) and dropped before each call (A)."""
    import throughput

    from scheduler.services.submit import job_submit
    from telemachus.control.config import config_cache_clear

    user, team = setup["users"][0]
    timings = {"A": [], "B": []}
    for i in range(2 * rounds):
        throughput.clear()
        variant = "AB"[i % 2]
        for _ in range(per_round):
            if variant == "A":
                config_cache_clear()
            started = time.perf_counter()
            job_submit(
                user=user,
                team=team.slug,
                type="chat",
                requirements={"model": "noop"},
                input={"messages": [{"role": "user", "content": "x"}]},
            )
            timings[variant].append((time.perf_counter() - started) * 1000)
    return {variant: {"submit": statistics.median(values)} for variant, values in timings.items()}


def finish_thread(setup: dict, database_url: str, *, jobs: int, repeats: int) -> dict:
    """jobs/s draining `jobs` no-op jobs with 2 workers, finishes on their own thread (B) or on the
    claim thread (A), interleaved."""
    import throughput
    from django.db.models import Max, Min

    from scheduler.models import Job

    rates = {"A": [], "B": []}
    for i in range(2 * repeats):
        variant = "AB"[i % 2]
        throughput.clear()
        throughput.queue(jobs, setup)
        env = {**os.environ, "DATABASE_URL": database_url, **PRODUCTION_ENV}
        argv = [sys.executable, __file__, "--worker", "--one-thread" if variant == "A" else "--two-threads"]
        procs = [subprocess.Popen([*argv, f"bench-{w}"], cwd=ROOT, env=env) for w in range(2)]
        for proc in procs:
            proc.wait(timeout=1800)
        done = Job.objects.filter(status="done")
        assert done.count() == jobs, f"only {done.count()} of {jobs} done"
        span = done.aggregate(first=Min("started_at"), last=Max("finished_at"))
        rates[variant].append(jobs / (span["last"] - span["first"]).total_seconds())
    return {variant: {"drain jobs/s": statistics.median(values)} for variant, values in rates.items()}


def worker(one_thread: bool, name: str) -> None:
    """A burst worker at --concurrency 64; with `one_thread`, as before: everything on one thread."""
    sys.path.insert(0, str(ROOT))
    import asyncio

    import django

    django.setup()
    from scheduler.worker.runner import Worker

    if one_thread:
        Worker.held_db = Worker.db
    asyncio.run(Worker(name=name, concurrency=64, burst=True).run())


@contextmanager
def _nothing():
    yield


# --- parent -------------------------------------------------------------------------------------


def run_backend(url: str, args: argparse.Namespace) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--child",
        url,
        "--rounds",
        str(args.rounds),
        "--batch",
        str(args.batch),
        "--drain",
        str(args.drain),
    ]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"benchmark on {url} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="rounds per variant and step")
    parser.add_argument("--batch", type=int, default=64, help="jobs per claim and per finish (at most 64: the caps)")
    parser.add_argument("--backends", default="postgres,sqlite")
    parser.add_argument("--drain", type=int, default=3000, help="no-op jobs per drain (0: skip the worker step)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-thread", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--two-threads", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        worker(args.one_thread, rest[0])
        return
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.batch, args.drain)))
        return

    table = {}
    for backend in args.backends.split(","):
        if backend == "postgres":
            pg_database(PG_BENCH_DB, "create")
            try:
                table[backend] = run_backend(pg_url(PG_BENCH_DB), args)
            finally:
                pg_database(PG_BENCH_DB, "drop")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                table[backend] = run_backend(f"sqlite:///{tmp}/bench.sqlite3", args)

    print(f"\nbatch {args.batch}, {args.rounds} rounds per variant (medians); A: before, B: now\n")
    print("| backend | step | measure | A (before) | B (now) | B / A |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for backend, steps in table.items():
        for step, variants in steps.items():
            for measure in variants["A"]:
                a, b = variants["A"][measure], variants["B"][measure]
                unit = "" if "jobs/s" in measure else " ms"
                print(f"| {backend} | {step} | {measure} | {a:.2f}{unit} | {b:.2f}{unit} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
