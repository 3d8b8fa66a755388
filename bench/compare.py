"""Telemachus side by side with Procrastinate and Celery, in one run. Prints one table.

    .venv/bin/python bench/compare.py [--jobs 5000] [--repeats 3] [--workers 2]

The same N no-op jobs through each system, on the same machine, the same PostgreSQL (a scratch
database `telemachus_bench_compare`, created and dropped) and, for Celery, the Redis at REDIS_URL
(default redis://127.0.0.1:6379/1; the database is flushed):

  Telemachus     all four caps in force (global, executor, team and user 1,000 slots each, so
                 they bind nothing but are checked), fair share on, DEBUG off; jobs on a `sim`
                 executor with zero latency; enqueue: `job_submit` one at a time and `jobs_submit`
                 in bulks of 1,000; process: --workers `scheduler_worker --burst --concurrency 64`
  Procrastinate  psycopg connector; enqueue: `task.defer()` one at a time and `task.batch_defer`
                 in bulks of 1,000; process: --workers `run_worker(concurrency=64, wait=False)`
  Celery         Redis broker, no result backend; enqueue: `task.delay()` one at a time, and a
                 `group` of 1,000 (Celery has no bulk publish: the group sends each message);
                 process: --workers prefork processes, prefetch 64 (each task also writes its
                 start and end to Redis, which is how the run is timed)

Enqueue rates are one client, in-process. Process rate is N / (first job started -> last job
ended), from each system's own records (Telemachus: the jobs' timestamps; Procrastinate: its
events table; Celery: the tasks' writes to Redis), so worker start-up is not counted. The systems
take turns in each repeat, in a rotating order; the table shows medians over repeats and each
peer's figure as a ratio to Telemachus's.

The peers run in their own environment, bench/.venv-peers, made from bench/requirements.txt on
first use (`--peers-python` points at another), never in the project's .venv.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
PG_BENCH_DB = "telemachus_bench_compare"
PEERS_VENV = BENCH / ".venv-peers"
BULK = 1000
SYSTEMS = ("telemachus", "procrastinate", "celery")
PRODUCTION_ENV = {
    "DJANGO_SETTINGS_MODULE": "telemachus.settings",
    "LOG_LEVEL": "WARNING",
    "DEBUG": "0",
    "SECRET_KEY": "bench-only-" + "x" * 50,
    "ALLOWED_HOSTS": "127.0.0.1",
}


def timed_rate(n: int, per_call: int, call) -> float:
    started = time.perf_counter()
    for _ in range(n // per_call):
        call()
    return n / (time.perf_counter() - started)


# --- Telemachus (the project's environment) -------------------------------------------------


def telemachus_run(database_url: str, jobs: int, workers: int) -> dict:
    os.environ.update(DATABASE_URL=database_url, **PRODUCTION_ENV)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import throughput
    from django.core.management import call_command
    from django.db.models import Max, Min

    from executors.models import Executor
    from quotas.models import QuotaPolicy
    from scheduler.models import Job, QueuePolicy
    from scheduler.services.submit import JobSpec, job_submit, jobs_submit

    call_command("migrate", verbosity=0)
    if not Executor.objects.exists():
        setup = throughput.seed()
        QuotaPolicy.objects.filter(dimension="ai.concurrency").update(limit=1000)
        Executor.objects.update(max_concurrency=1000)
        QueuePolicy.objects.update_or_create(pk=1, defaults={"max_queue_depth": {"default": 10 * jobs}})
    else:
        from django.contrib.auth import get_user_model

        from telemachus.models import Team

        setup = {"users": [(get_user_model().objects.get(username=n), Team.objects.get(slug=n)) for n in ("t1", "t2")]}
    user, team = setup["users"][0]
    body = {
        "type": "chat",
        "requirements": {"model": "noop"},
        "input": {"messages": [{"role": "user", "content": "x"}]},
    }
    result = {}
    throughput.clear()
    result["enqueue one by one"] = timed_rate(jobs, 1, lambda: job_submit(user=user, team=team.slug, **body))
    throughput.clear()
    bulk = [JobSpec(team=team.slug, **body) for _ in range(BULK)]
    result["enqueue bulk"] = timed_rate(jobs, BULK, lambda: jobs_submit(user=user, jobs=bulk))
    procs = throughput.start_workers(workers, database_url, burst=True, concurrency=64)
    for proc in procs:
        proc.wait(timeout=1800)
    done = Job.objects.filter(status="done")
    assert done.count() == jobs, f"telemachus: {done.count()} of {jobs} done"
    span = done.aggregate(first=Min("started_at"), last=Max("finished_at"))
    result["process"] = jobs / (span["last"] - span["first"]).total_seconds()
    throughput.clear()
    return result


# --- Procrastinate and Celery (bench/.venv-peers) ---------------------------------------------


def procrastinate_app(database_url: str):
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=database_url.replace("postgres://", "postgresql://"))
    )

    @app.task(name="noop")
    def noop() -> None:
        pass

    return app, noop


def procrastinate_run(database_url: str, jobs: int, workers: int) -> dict:
    import psycopg

    app, noop = procrastinate_app(database_url)
    conninfo = database_url.replace("postgres://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]
    result = {}
    with app.open():
        if not exists:
            app.schema_manager.apply_schema()

        def clear() -> None:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute("TRUNCATE procrastinate_jobs CASCADE")

        clear()
        result["enqueue one by one"] = timed_rate(jobs, 1, noop.defer)
        clear()
        result["enqueue bulk"] = timed_rate(jobs, BULK, lambda: noop.batch_defer(*([{}] * BULK)))
    procs = [
        subprocess.Popen([sys.executable, __file__, "--peer", "procrastinate-worker", database_url])
        for _ in range(workers)
    ]
    for proc in procs:
        proc.wait(timeout=1800)
    with psycopg.connect(conninfo) as conn:
        succeeded = conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'").fetchone()[0]
        first, last = conn.execute(
            "SELECT min(at) FILTER (WHERE type = 'started'), max(at) FILTER (WHERE type = 'succeeded') "
            "FROM procrastinate_events"
        ).fetchone()
        conn.execute("TRUNCATE procrastinate_jobs CASCADE")
    assert succeeded == jobs, f"procrastinate: {succeeded} of {jobs} succeeded"
    result["process"] = jobs / (last - first).total_seconds()
    return result


def procrastinate_worker(database_url: str) -> None:
    app, _ = procrastinate_app(database_url)
    with app.open():
        app.run_worker(concurrency=64, wait=False, install_signal_handlers=False)


def celery_app(redis_url: str):
    import redis
    from celery import Celery

    app = Celery("bench", broker=redis_url)
    app.conf.update(
        task_ignore_result=True,
        worker_prefetch_multiplier=64,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    store = redis.Redis.from_url(redis_url)

    @app.task(name="noop")
    def noop() -> None:
        now = time.time()
        pipe = store.pipeline()
        pipe.set("bench:first", now, nx=True)
        pipe.set("bench:last", now)
        pipe.incr("bench:done")
        pipe.execute()

    return app, noop, store


def celery_run(redis_url: str, jobs: int, workers: int) -> dict:
    from celery import group

    app, noop, store = celery_app(redis_url)
    result = {}
    store.flushdb()
    result["enqueue one by one"] = timed_rate(jobs, 1, noop.delay)
    store.flushdb()
    result["enqueue bulk"] = timed_rate(jobs, BULK, lambda: group(noop.s() for _ in range(BULK)).apply_async())
    worker = subprocess.Popen(
        [sys.executable, __file__, "--peer", "celery-worker", redis_url, str(workers)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 1800
        while int(store.get("bench:done") or 0) < jobs:
            assert time.monotonic() < deadline, "celery: jobs not done in time"
            time.sleep(0.05)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    first, last = float(store.get("bench:first")), float(store.get("bench:last"))
    result["process"] = jobs / (last - first)
    store.flushdb()
    return result


def celery_worker(redis_url: str, workers: int) -> None:
    app, _, _ = celery_app(redis_url)
    app.worker_main(
        [
            "worker",
            "--pool",
            "prefork",
            "--concurrency",
            str(workers),
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )


# --- the run --------------------------------------------------------------------------------------


def peers_python(given: str | None) -> str:
    if given:
        return given
    python = PEERS_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(BENCH / "requirements.txt")], check=True)
    return str(python)


def run(system: str, args: argparse.Namespace, database_url: str, redis_url: str, peers: str) -> dict:
    python = sys.executable if system == "telemachus" else peers
    target = redis_url if system == "celery" else database_url
    argv = [python, __file__, "--peer", system, target, "--jobs", str(args.jobs), "--workers", str(args.workers)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{system} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--peers-python", help="python of an environment with bench/requirements.txt installed")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.peer:
        peer(args.peer, rest, args)
        return

    from benchlib import pg_database, pg_url

    assert args.jobs % BULK == 0, f"--jobs must be a multiple of {BULK}"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/1")
    peers = peers_python(args.peers_python)
    results: dict[str, list[dict]] = {system: [] for system in SYSTEMS}
    pg_database(PG_BENCH_DB, "create")
    try:
        database_url = pg_url(PG_BENCH_DB)
        for repeat in range(args.repeats):
            order = SYSTEMS[repeat % 3 :] + SYSTEMS[: repeat % 3]
            for system in order:
                results[system].append(run(system, args, database_url, redis_url, peers))
                print(f"repeat {repeat + 1}, {system}: {results[system][-1]}", file=sys.stderr)
    finally:
        pg_database(PG_BENCH_DB, "drop")

    measures = ("enqueue one by one", "enqueue bulk", "process")
    median = {s: {m: statistics.median(r[m] for r in results[s]) for m in measures} for s in SYSTEMS}
    print(
        f"\n{args.jobs} no-op jobs, {args.workers} worker processes each, medians of {args.repeats} "
        "interleaved repeats (jobs/s; ratio: Telemachus / peer)\n"
    )
    print("| measure | Telemachus | Procrastinate | Celery | vs Procrastinate | vs Celery |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for m in measures:
        t, p, c = (median[s][m] for s in SYSTEMS)
        print(f"| {m} | {t:,.0f} | {p:,.0f} | {c:,.0f} | {t / p:.2f} | {t / c:.2f} |")


def peer(name: str, rest: list[str], args: argparse.Namespace) -> None:
    if name == "procrastinate-worker":
        procrastinate_worker(rest[0])
    elif name == "celery-worker":
        celery_worker(rest[0], int(rest[1]))
    else:
        run_one = {"telemachus": telemachus_run, "procrastinate": procrastinate_run, "celery": celery_run}[name]
        print(json.dumps(run_one(rest[0], args.jobs, args.workers)))


if __name__ == "__main__":
    main()
