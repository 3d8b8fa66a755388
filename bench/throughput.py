"""Throughput and latency of the governed claim, on PostgreSQL and SQLite. Prints a table.

    .venv/bin/python bench/throughput.py [--jobs 5000] [--backends postgres,sqlite] [--concurrency 16,64]

For each backend, in a fresh database with all four caps in force (global, executor, team, user):
  * jobs/s: N no-op jobs (sim executor, zero latency) queued, then drained by 1, 2 and 4 worker
    processes, at each --concurrency (dispatches in flight per worker, so also the most jobs one
    claim takes); measured from the first start to the last finish in the database, so process
    start-up is not counted;
  * claim latency p50/p99 (one job per claim, in-process) with 1k, 10k and 100k jobs queued;
  * placement latency p50/p99: submit -> start of dispatch, one worker idle and waiting, jobs
    submitted one at a time.
PostgreSQL runs in a scratch database `telemachus_bench` on 127.0.0.1 (created and dropped).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = "telemachus_bench"
# As a deployment runs: DEBUG off (Django then keeps no per-query log), quiet logs.
PRODUCTION_ENV = {"DJANGO_SETTINGS_MODULE": "telemachus.settings", "LOG_LEVEL": "WARNING", "DEBUG": "0",
                  "SECRET_KEY": "bench-only-" + "x" * 50, "ALLOWED_HOSTS": "127.0.0.1"}




# --- child: one backend ---------------------------------------------------------------------


def child(database_url: str, jobs: int, concurrencies: list[int]) -> dict:
    os.environ.update(DATABASE_URL=database_url, **PRODUCTION_ENV)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    setup = seed()
    results = {"drain": {}, "claim": {}, "placement": None}
    for concurrency in concurrencies:
        results["drain"][concurrency] = {
            workers: drain(jobs, workers, setup, database_url, concurrency) for workers in (1, 2, 4)
        }
    for depth in (1_000, 10_000, 100_000):
        results["claim"][depth] = claim_latency(depth, setup)
    results["placement"] = placement_latency(setup, database_url)
    return results


def seed() -> dict:
    from django.contrib.auth import get_user_model

    from executors.models import Executor
    from quotas.models import QuotaPolicy
    from telemachus.services import team_create, team_member_set

    users = []
    for name in ("t1", "t2"):
        user = get_user_model().objects.create_user(name)
        team = team_create(slug=name, name=name)
        team_member_set(team=team, username=name, role="member")
        users.append((user, team))
    Executor.objects.create(name="sim", kind="sim", capabilities={"models": ["noop"]}, max_concurrency=64,
                            meta={"latency_ms": 0, "output_tokens": 1})
    for scope, subject, limit in (("global", "", 64), ("executor", "sim", 64), ("team", "t1", 40),
                                  ("team", "t2", 40), ("user", "t1", 40), ("user", "t2", 40)):
        QuotaPolicy.objects.create(scope=scope, subject=subject, dimension="ai.concurrency", limit=limit)
    return {"users": users}


def queue(n: int, setup: dict) -> None:
    from django.db import connection, transaction
    from django.utils import timezone

    from scheduler.models import Job

    now = timezone.now()
    rows = []
    for i in range(n):
        user, team = setup["users"][i % 2]
        rows.append(Job(type="chat", user=user, team=team, requirements={"model": "noop"}, model="noop",
                        input={"messages": [{"role": "user", "content": "x"}]}, submitted_at=now))
    with transaction.atomic():
        Job.objects.bulk_create(rows, batch_size=5000)
    if connection.vendor == "postgresql":
        # What autovacuum does within a minute of a bulk load; without fresh statistics the planner
        # may pick a plan for an empty table.
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE scheduler_job")


def clear() -> None:
    from scheduler.models import Job, JobEvent, Slot

    Slot.objects.all().delete()
    JobEvent.objects.all().delete()
    Job.objects.all().delete()


def start_workers(n: int, database_url: str, *, burst: bool, concurrency: int = 16) -> list[subprocess.Popen]:
    env = {**os.environ, "DATABASE_URL": database_url, **PRODUCTION_ENV}
    args = ["--burst"] if burst else []
    return [
        subprocess.Popen([sys.executable, "manage.py", "scheduler_worker", "--concurrency", str(concurrency),
                          "--name", f"bench-{i}", *args], cwd=ROOT, env=env)
        for i in range(n)
    ]


def drain(jobs: int, workers: int, setup: dict, database_url: str, concurrency: int) -> float:
    from django.db.models import Max, Min

    from scheduler.models import Job

    clear()
    queue(jobs, setup)
    procs = start_workers(workers, database_url, burst=True, concurrency=concurrency)
    for proc in procs:
        proc.wait(timeout=1800)
    done = Job.objects.filter(status="done")
    assert done.count() == jobs, f"only {done.count()} of {jobs} jobs done"
    span = done.aggregate(first=Min("started_at"), last=Max("finished_at"))
    return jobs / (span["last"] - span["first"]).total_seconds()


def claim_latency(depth: int, setup: dict, samples: int = 300) -> tuple[float, float]:
    from scheduler.services.claim import job_claim
    from scheduler.services.finish import job_finish

    clear()
    queue(depth, setup)
    timings = []
    for _ in range(samples):
        started = time.perf_counter()
        (claim,) = job_claim(worker="bench", limit=1).claims
        timings.append((time.perf_counter() - started) * 1000)
        job_finish(job_id=claim.job.pk, lease=claim.lease, result={})
    return percentile(timings, 0.5), percentile(timings, 0.99)


def placement_latency(setup: dict, database_url: str, samples: int = 200) -> tuple[float, float]:
    from scheduler.models import Job
    from scheduler.services.submit import job_submit

    clear()
    procs = start_workers(1, database_url, burst=False)
    try:
        user, team = setup["users"][0]
        time.sleep(3)  # let the worker start and go idle
        latencies = []
        for _ in range(samples):
            job = job_submit(user=user, team=team.slug, type="chat", requirements={"model": "noop"},
                             input={"messages": [{"role": "user", "content": "x"}]})
            deadline = time.monotonic() + 10
            while (started := Job.objects.filter(pk=job.pk).values_list("started_at", flat=True)[0]) is None:
                assert time.monotonic() < deadline, "job never started"
                time.sleep(0.001)
            latencies.append((started - job.submitted_at).total_seconds() * 1000)
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    return percentile(latencies, 0.5), percentile(latencies, 0.99)


# --- parent: run each backend in its own process and print the table ------------------------------


def run_backend(url: str, jobs: int, concurrency: str) -> dict:
    argv = [sys.executable, __file__, "--child", url, "--jobs", str(jobs), "--concurrency", concurrency]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"benchmark on {url} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--backends", default="postgres,sqlite")
    parser.add_argument("--concurrency", default="16,64", help="worker --concurrency values to drain with")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.jobs, [int(c) for c in args.concurrency.split(",")])))
        return

    table = {}
    for backend in args.backends.split(","):
        if backend == "postgres":
            pg_database(PG_BENCH_DB, "create")
            try:
                table[backend] = run_backend(pg_url(PG_BENCH_DB), args.jobs, args.concurrency)
            finally:
                pg_database(PG_BENCH_DB, "drop")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                table[backend] = run_backend(f"sqlite:///{tmp}/bench.sqlite3", args.jobs, args.concurrency)

    print(f"\nthroughput: {args.jobs} no-op jobs through sim, caps in force at all four scopes\n")
    print(f"{'backend':<10} {'concurrency':>11} {'1 worker':>10} {'2 workers':>10} {'4 workers':>10}   (jobs/s)")
    for backend, r in table.items():
        for concurrency, by_workers in r["drain"].items():
            rates = " ".join(f"{by_workers[str(w)]:>10.0f}" for w in (1, 2, 4))
            print(f"{backend:<10} {concurrency:>11} {rates}")
    print(f"\n{'backend':<10} {'queued':>8} {'claim p50 ms':>13} {'claim p99 ms':>13}")
    for backend, r in table.items():
        for depth in ("1000", "10000", "100000"):
            p50, p99 = r["claim"][depth]
            print(f"{backend:<10} {int(depth):>8} {p50:>13.2f} {p99:>13.2f}")
    print(f"\n{'backend':<10} {'placement p50 ms':>17} {'placement p99 ms':>17}   (submit -> dispatch, idle worker)")
    for backend, r in table.items():
        p50, p99 = r["placement"]
        print(f"{backend:<10} {p50:>17.1f} {p99:>17.1f}")


if __name__ == "__main__":
    main()
