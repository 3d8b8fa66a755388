"""Throughput and latency of the governed claim and of submit, on PostgreSQL and SQLite. Prints
tables.

    .venv/bin/python bench/throughput.py [--jobs 5000] [--backends postgres,sqlite] [--concurrency 16,64]
                                         [--depths 1000,10000,100000,1000000] [--submits 2000]

For each backend, in a fresh database with all four caps in force (global, executor, team, user):
  * jobs/s: N no-op jobs (sim executor, zero latency) queued, then drained by 1, 2 and 4 worker
    processes, at each --concurrency (dispatches in flight per worker, so also the most jobs one
    claim takes); measured from the first start to the last finish in the database, so process
    start-up is not counted;
  * claim latency p50/p99 (one job per claim, in-process) with each of --depths jobs queued;
  * placement latency p50/p99: submit -> start of dispatch, one worker idle and waiting, jobs
    submitted one at a time;
  * submit rate, one client, one job at a time: `job_submit` in-process (service) and
    `POST /api/jobs/` with a token over one keep-alive connection to daphne (HTTP), jobs/s and
    p50 ms per submit; and in bulks of 1,000: `jobs_submit` and `POST /api/jobs/bulk/`. The
    queue is emptied between runs (each submit counts its team's queue up to the depth cap).
PostgreSQL runs in a scratch database `telemachus_bench` on 127.0.0.1 (created and dropped).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = "telemachus_bench"
# As a deployment runs: DEBUG off (Django then keeps no per-query log), quiet logs.
PRODUCTION_ENV = {
    "DJANGO_SETTINGS_MODULE": "telemachus.settings",
    "LOG_LEVEL": "WARNING",
    "DEBUG": "0",
    "SECRET_KEY": "bench-only-" + "x" * 50,
    "ALLOWED_HOSTS": "127.0.0.1",
}


# --- child: one backend ---------------------------------------------------------------------


def child(database_url: str, jobs: int, concurrencies: list[int], depths: list[int], submits: int) -> dict:
    os.environ.update(DATABASE_URL=database_url, **PRODUCTION_ENV)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    setup = seed()
    results = {"drain": {}, "claim": {}, "placement": None, "submit": None}
    for concurrency in concurrencies:
        results["drain"][concurrency] = {
            workers: drain(jobs, workers, setup, database_url, concurrency) for workers in (1, 2, 4)
        }
    for depth in depths:
        results["claim"][depth] = claim_latency(depth, setup)
    results["placement"] = placement_latency(setup, database_url)
    if submits:
        results["submit"] = submit_rates(setup, database_url, submits)
    return results


def seed() -> dict:
    from django.contrib.auth import get_user_model

    from executors.models import Executor
    from quotas.models import QuotaPolicy
    from telemachus.teams.services import team_create, team_member_set

    users = []
    for name in ("t1", "t2"):
        user = get_user_model().objects.create_user(name)
        team = team_create(slug=name, name=name)
        team_member_set(team=team, username=name, role="member")
        users.append((user, team))
    Executor.objects.create(
        name="sim",
        kind="sim",
        capabilities={"models": ["noop"]},
        max_concurrency=64,
        meta={"latency_ms": 0, "output_tokens": 1},
    )
    for scope, subject, limit in (
        ("global", "", 64),
        ("executor", "sim", 64),
        ("team", "t1", 40),
        ("team", "t2", 40),
        ("user", "t1", 40),
        ("user", "t2", 40),
    ):
        QuotaPolicy.objects.create(scope=scope, subject=subject, dimension="ai.concurrency", limit=limit)
    return {"users": users}


def queue(n: int, setup: dict) -> None:
    from django.db import connection, transaction
    from django.utils import timezone

    from scheduler.models import Job

    now = timezone.now()
    with transaction.atomic():
        for start in range(0, n, 50_000):  # built in chunks: a million Job instances do not fit
            rows = []
            for i in range(start, min(n, start + 50_000)):
                user, team = setup["users"][i % 2]
                rows.append(
                    Job(
                        type="chat",
                        user=user,
                        team=team,
                        requirements={"model": "noop"},
                        model="noop",
                        input={"messages": [{"role": "user", "content": "x"}]},
                        submitted_at=now,
                    )
                )
            Job.objects.bulk_create(rows, batch_size=5000)
    if connection.vendor == "postgresql":
        # What autovacuum does within a minute of a bulk load; without fresh statistics the planner
        # may pick a plan for an empty table.
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE scheduler_job")


def clear() -> None:
    from django.db import connection

    from scheduler.models import Job, JobEvent, Slot

    Slot.objects.all().delete()
    JobEvent.objects.all().delete()
    Job.objects.all().delete()
    if connection.vendor == "postgresql":
        # Without it the next phase walks the dead index entries of what was just deleted (a
        # million after the deepest claim-latency run) until autovacuum comes by.
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE scheduler_job")


def start_workers(n: int, database_url: str, *, burst: bool, concurrency: int = 16) -> list[subprocess.Popen]:
    env = {**os.environ, "DATABASE_URL": database_url, **PRODUCTION_ENV}
    args = ["--burst"] if burst else []
    return [
        subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "scheduler_worker",
                "--concurrency",
                str(concurrency),
                "--name",
                f"bench-{i}",
                *args,
            ],
            cwd=ROOT,
            env=env,
        )
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
            job = job_submit(
                user=user,
                team=team.slug,
                type="chat",
                requirements={"model": "noop"},
                input={"messages": [{"role": "user", "content": "x"}]},
            )
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


SUBMIT_BODY = {
    "type": "chat",
    "requirements": {"model": "noop"},
    "input": {"messages": [{"role": "user", "content": "x"}]},
}
BULK = 1000


def submit_rates(setup: dict, database_url: str, n: int) -> dict:
    """jobs/s (and p50 ms per call) for one client submitting `n` jobs: one at a time and in bulks
    of BULK, in-process and over HTTP."""
    import httpx

    from scheduler.services.submit import JobSpec, job_submit, jobs_submit
    from telemachus.keys.services import personal_token_issue

    user, team = setup["users"][0]
    results = {}

    def timed(name: str, calls: int, per_call: int, call) -> None:
        clear()
        call()  # warm-up: first-use caches, connection
        clear()
        latencies = []
        started = time.perf_counter()
        for _ in range(calls):
            one = time.perf_counter()
            call()
            latencies.append((time.perf_counter() - one) * 1000)
        results[name] = {
            "jobs/s": calls * per_call / (time.perf_counter() - started),
            "p50 ms": percentile(latencies, 0.5),
        }

    timed("service", n, 1, lambda: job_submit(user=user, team=team.slug, **SUBMIT_BODY))
    bulk = [JobSpec(team=team.slug, **SUBMIT_BODY) for _ in range(BULK)]
    timed("service bulk", max(n // BULK, 1), BULK, lambda: jobs_submit(user=user, jobs=bulk))

    port = free_port()
    env = {**os.environ, "DATABASE_URL": database_url, **PRODUCTION_ENV, "SECURE_SSL_REDIRECT": "0"}
    server = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "telemachus.asgi:application"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.DEVNULL,
    )
    headers = {"Authorization": f"Token {personal_token_issue(user=user)[1]}"}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.get("/api/schema/")
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "daphne did not start"
                    time.sleep(0.2)

            def post(path: str, body: dict) -> None:
                response = client.post(path, json=body)
                assert response.status_code == 201, response.text[:500]

            timed("HTTP", n, 1, lambda: post("/api/jobs/", {**SUBMIT_BODY, "team": team.slug}))
            jobs = [{**SUBMIT_BODY, "team": team.slug} for _ in range(BULK)]
            timed("HTTP bulk", max(n // BULK, 1), BULK, lambda: post("/api/jobs/bulk/", {"jobs": jobs}))
    finally:
        server.terminate()
        server.wait(timeout=30)
    clear()
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- parent: run each backend in its own process and print the table ------------------------------


def run_backend(url: str, args: argparse.Namespace) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--child",
        url,
        "--jobs",
        str(args.jobs),
        "--concurrency",
        args.concurrency,
        "--depths",
        args.depths,
        "--submits",
        str(args.submits),
    ]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"benchmark on {url} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--backends", default="postgres,sqlite")
    parser.add_argument("--concurrency", default="16,64", help="worker --concurrency values to drain with")
    parser.add_argument("--depths", default="1000,10000,100000,1000000", help="queue depths for claim latency")
    parser.add_argument("--submits", type=int, default=2000, help="jobs per submit-rate run (0: skip)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(
                child(
                    args.child,
                    args.jobs,
                    [int(c) for c in args.concurrency.split(",")],
                    [int(d) for d in args.depths.split(",")],
                    args.submits,
                )
            )
        )
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

    print(f"\nthroughput: {args.jobs} no-op jobs through sim, caps in force at all four scopes\n")
    print(f"{'backend':<10} {'concurrency':>11} {'1 worker':>10} {'2 workers':>10} {'4 workers':>10}   (jobs/s)")
    for backend, r in table.items():
        for concurrency, by_workers in r["drain"].items():
            rates = " ".join(f"{by_workers[str(w)]:>10.0f}" for w in (1, 2, 4))
            print(f"{backend:<10} {concurrency:>11} {rates}")
    print(f"\n{'backend':<10} {'queued':>8} {'claim p50 ms':>13} {'claim p99 ms':>13}")
    for backend, r in table.items():
        for depth, (p50, p99) in r["claim"].items():
            print(f"{backend:<10} {int(depth):>8} {p50:>13.2f} {p99:>13.2f}")
        depths = sorted(r["claim"], key=int)
        if len(depths) > 1:
            ratio = r["claim"][depths[-1]][0] / r["claim"][depths[0]][0]
            print(f"{backend:<10} p50 at {int(depths[-1]):,} / at {int(depths[0]):,} queued: {ratio:.2f}x")
    print(f"\n{'backend':<10} {'placement p50 ms':>17} {'placement p99 ms':>17}   (submit -> dispatch, idle worker)")
    for backend, r in table.items():
        p50, p99 = r["placement"]
        print(f"{backend:<10} {p50:>17.1f} {p99:>17.1f}")
    print(f"\n{'backend':<10} {'submit':<14} {'jobs/s':>9} {'p50 ms/call':>12}   (one client)")
    for backend, r in table.items():
        for way, result in (r["submit"] or {}).items():
            print(f"{backend:<10} {way:<14} {result['jobs/s']:>9.0f} {result['p50 ms']:>12.2f}")


if __name__ == "__main__":
    main()
