"""Telemachus side by side with Procrastinate and Celery, in one run, each at its best. Prints tables.

    .venv/bin/python bench/compare.py [--jobs 5000] [--repeats 3]
                                      [--telemachus 1x64,2x16,2x64,2x256,4x16]
                                      [--procrastinate 1x64,2x2,2x8,2x64,4x1]
                                      [--celery 1x64,2x1,2x16,2x64,4x16]

The same N no-op jobs through each system, on the same machine, the same PostgreSQL (a scratch
database, `telemachus_bench_compare` unless --database names another, created and dropped) and, for
Celery, the Redis at REDIS_URL (default redis://127.0.0.1:6379/1; the database is flushed):

  Telemachus     all four caps in force (global, executor, team and user 1,000 slots each, so
                 they bind nothing but are checked), fair share on, DEBUG off; jobs on a `sim`
                 executor with zero latency; enqueue: `job_submit` one at a time and `jobs_submit`
                 in bulks of 1,000; process: P `scheduler_worker --burst --concurrency C`
  Procrastinate  psycopg connector, the task a coroutine (its worker runs a plain function in a
                 thread); enqueue: `task.defer()` one at a time and `task.batch_defer` in bulks
                 of 1,000; process: P processes of `run_worker(concurrency=C, wait=False)`
  Celery         Redis broker, no result backend; enqueue: `task.delay()` one at a time, and a
                 `group` of 1,000 (Celery has no bulk publish: the group sends each message);
                 process: one worker of P prefork processes, prefetch multiplier C (each task also
                 writes its start and end to Redis, which is how the run is timed)

Each system gets its best configuration: the process rate is measured at every PxC of its sweep
(the flags above, defaults shown), and the first table shows each system at its best (the
highest median over repeats) with the configuration that gave it; the second, the whole sweep.
On a 2-core machine the best is not the most processes: they share the cores with PostgreSQL
(measured independently here, Procrastinate processed 898 jobs/s with 2 processes x concurrency 2
against 335 with 2 x 64).

Enqueue rates are one client, in-process: one by one once per repeat, bulk before each
configuration's processing (its median over all of them). Process rate is N / (first job started
-> last job ended), from each system's own records (Telemachus: the jobs' timestamps;
Procrastinate: its events table; Celery: the tasks' writes to Redis), so worker start-up is not
counted. The systems take turns in each repeat, in a rotating order, and so do the configurations
within a system; the tables show medians over repeats and each peer's figure as a ratio to
Telemachus's.

The peers run in their own environment, bench/.venv-peers, made from bench/requirements.txt on
first use and refreshed when that file changes (`--peers-python` points at another), never in the
project's .venv.
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
BULK = 1000
SYSTEMS = ("telemachus", "procrastinate", "celery")
NAMES = {"telemachus": "Telemachus", "procrastinate": "Procrastinate", "celery": "Celery"}
# What P x C means for each system.
CONFIG_MEANING = {
    "telemachus": "worker processes x --concurrency",
    "procrastinate": "worker processes x concurrency",
    "celery": "prefork processes x prefetch multiplier",
}
DEFAULT_SWEEP = {
    "telemachus": "1x64,2x16,2x64,2x256,4x16",
    "procrastinate": "1x64,2x2,2x8,2x64,4x1",
    "celery": "1x64,2x1,2x16,2x64,4x16",
}
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


def configurations(text: str) -> list[tuple[int, int]]:
    """ "2x8,4x1" -> [(2, 8), (4, 1)]: processes x concurrency (or prefetch); "" leaves the system out
    (`--procrastinate '' --celery ''` measures Telemachus alone, as a before/after of one change)."""
    pairs = []
    for part in filter(None, text.split(",")):
        processes, _, concurrency = part.strip().partition("x")
        pairs.append((int(processes), int(concurrency)))
    return pairs


def label(config: tuple[int, int]) -> str:
    return f"{config[0]}x{config[1]}"


# --- Telemachus (the project's environment) -------------------------------------------------


def telemachus_run(database_url: str, jobs: int, configs: list[tuple[int, int]]) -> dict:
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
    bulk_size = min(BULK, jobs)
    bulk = [JobSpec(team=team.slug, **body) for _ in range(bulk_size)]
    throughput.clear()
    result: dict = {"enqueue one by one": timed_rate(jobs, 1, lambda: job_submit(user=user, team=team.slug, **body))}
    result["configs"] = {}
    for processes, concurrency in configs:
        throughput.clear()
        enqueue = timed_rate(jobs, bulk_size, lambda: jobs_submit(user=user, jobs=bulk))
        procs = throughput.start_workers(processes, database_url, burst=True, concurrency=concurrency)
        for proc in procs:
            proc.wait(timeout=1800)
        done = Job.objects.filter(status="done")
        assert done.count() == jobs, f"telemachus {processes}x{concurrency}: {done.count()} of {jobs} done"
        span = done.aggregate(first=Min("started_at"), last=Max("finished_at"))
        process = jobs / (span["last"] - span["first"]).total_seconds()
        result["configs"][label((processes, concurrency))] = {"enqueue bulk": enqueue, "process": process}
    throughput.clear()
    return result


# --- Procrastinate and Celery (bench/.venv-peers) ---------------------------------------------


def procrastinate_app(database_url: str):
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=database_url.replace("postgres://", "postgresql://"))
    )

    # A coroutine: the worker runs a plain function in a thread, which only slows it down.
    @app.task(name="noop")
    async def noop() -> None:
        pass

    return app, noop


def procrastinate_run(database_url: str, jobs: int, configs: list[tuple[int, int]]) -> dict:
    import psycopg

    app, noop = procrastinate_app(database_url)
    conninfo = database_url.replace("postgres://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]

    def clear() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("TRUNCATE procrastinate_jobs CASCADE")

    bulk_size = min(BULK, jobs)
    result: dict = {"configs": {}}
    with app.open():
        if not exists:
            app.schema_manager.apply_schema()
        clear()
        result["enqueue one by one"] = timed_rate(jobs, 1, noop.defer)
    for processes, concurrency in configs:
        clear()
        with app.open():
            enqueue = timed_rate(jobs, bulk_size, lambda: noop.batch_defer(*([{}] * bulk_size)))
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--peer", "procrastinate-worker", database_url, str(concurrency)]
            )
            for _ in range(processes)
        ]
        for proc in procs:
            proc.wait(timeout=1800)
        with psycopg.connect(conninfo) as conn:
            succeeded = conn.execute("SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'").fetchone()[0]
            first, last = conn.execute(
                "SELECT min(at) FILTER (WHERE type = 'started'), max(at) FILTER (WHERE type = 'succeeded') "
                "FROM procrastinate_events"
            ).fetchone()
        assert succeeded == jobs, f"procrastinate {processes}x{concurrency}: {succeeded} of {jobs} succeeded"
        process = jobs / (last - first).total_seconds()
        result["configs"][label((processes, concurrency))] = {"enqueue bulk": enqueue, "process": process}
    clear()
    return result


def procrastinate_worker(database_url: str, concurrency: int) -> None:
    app, _ = procrastinate_app(database_url)
    with app.open():
        app.run_worker(concurrency=concurrency, wait=False, install_signal_handlers=False)


def celery_app(redis_url: str, prefetch: int = 1):
    import redis
    from celery import Celery

    app = Celery("bench", broker=redis_url)
    app.conf.update(
        task_ignore_result=True,
        worker_prefetch_multiplier=prefetch,
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


def celery_run(redis_url: str, jobs: int, configs: list[tuple[int, int]]) -> dict:
    from celery import group

    app, noop, store = celery_app(redis_url)
    bulk_size = min(BULK, jobs)
    store.flushdb()
    result: dict = {"enqueue one by one": timed_rate(jobs, 1, noop.delay), "configs": {}}
    for processes, prefetch in configs:
        store.flushdb()
        enqueue = timed_rate(jobs, bulk_size, lambda: group(noop.s() for _ in range(bulk_size)).apply_async())
        worker = subprocess.Popen(
            [sys.executable, __file__, "--peer", "celery-worker", redis_url, str(processes), str(prefetch)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 1800
            while int(store.get("bench:done") or 0) < jobs:
                assert time.monotonic() < deadline, f"celery {processes}x{prefetch}: jobs not done in time"
                time.sleep(0.05)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
        first, last = float(store.get("bench:first")), float(store.get("bench:last"))
        result["configs"][label((processes, prefetch))] = {"enqueue bulk": enqueue, "process": jobs / (last - first)}
    store.flushdb()
    return result


def celery_worker(redis_url: str, processes: int, prefetch: int) -> None:
    app, _, _ = celery_app(redis_url, prefetch)
    app.worker_main(
        [
            "worker",
            "--pool",
            "prefork",
            "--concurrency",
            str(processes),
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )


# --- the run --------------------------------------------------------------------------------------


def run(system: str, configs: list[tuple[int, int]], args: argparse.Namespace, targets: dict, peers: str) -> dict:
    python = sys.executable if system == "telemachus" else peers
    target = targets["redis"] if system == "celery" else targets["database"]
    sweep = ",".join(label(config) for config in configs)
    argv = [python, __file__, "--peer", system, target, "--jobs", str(args.jobs), f"--{system}", sweep]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{system} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    for system in SYSTEMS:
        parser.add_argument(
            f"--{system}",
            type=configurations,
            default=configurations(DEFAULT_SWEEP[system]),
            help=f"configurations to sweep, PxC: {CONFIG_MEANING[system]} (default {DEFAULT_SWEEP[system]})",
        )
    parser.add_argument("--peers-python", help="python of an environment with bench/requirements.txt installed")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument(
        "--database", default=PG_BENCH_DB, help=f"the scratch database, created and dropped (default {PG_BENCH_DB})"
    )
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.peer:
        peer(args.peer, rest, args)
        return

    from benchlib import peers_python, pg_database, pg_url

    assert args.jobs % min(BULK, args.jobs) == 0, f"--jobs must be under {BULK} or a multiple of it"
    systems = [system for system in SYSTEMS if getattr(args, system)]
    peers = peers_python(args.peers_python) if systems != ["telemachus"] else ""
    targets = {"redis": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/1"), "database": pg_url(args.database)}
    results: dict[str, list[dict]] = {system: [] for system in systems}
    pg_database(args.database, "create")
    try:
        for repeat in range(args.repeats):
            shift = repeat % len(systems)
            order = systems[shift:] + systems[:shift]
            for system in order:
                sweep = getattr(args, system)
                shift = repeat % len(sweep)
                results[system].append(run(system, sweep[shift:] + sweep[:shift], args, targets, peers))
                print(f"repeat {repeat + 1}, {system}: {results[system][-1]}", file=sys.stderr)
    finally:
        pg_database(args.database, "drop")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, args)


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    """Each system at its best (the configuration with the highest median process rate), then the
    whole sweep."""
    systems = list(results)
    process = {
        system: {
            config: [repeat["configs"][config]["process"] for repeat in results[system]]
            for config in results[system][0]["configs"]
        }
        for system in systems
    }
    best = {s: max(process[s], key=lambda c, s=s: statistics.median(process[s][c])) for s in systems}
    median = {
        system: {
            "enqueue one by one": statistics.median(r["enqueue one by one"] for r in results[system]),
            "enqueue bulk": statistics.median(
                c["enqueue bulk"] for r in results[system] for c in r["configs"].values()
            ),
            "process, each at its best": statistics.median(process[system][best[system]]),
        }
        for system in systems
    }
    peers = [system for system in systems if system != "telemachus"]
    print(
        f"\n{args.jobs} no-op jobs, medians of {args.repeats} interleaved repeats (jobs/s; ratio: Telemachus / peer)\n"
    )
    columns = [NAMES[system] for system in systems] + [f"vs {NAMES[peer]}" for peer in peers]
    print("| measure | " + " | ".join(columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for measure in median["telemachus"]:
        figures = [f"{median[system][measure]:,.0f}" for system in systems]
        ratios = [f"{median['telemachus'][measure] / median[peer][measure]:.2f}" for peer in peers]
        print(f"| {measure} | " + " | ".join(figures + ratios) + " |")
    print("| best configuration (PxC) | " + " | ".join([best[s] for s in systems] + [""] * len(peers)) + " |")
    print("\nEvery configuration: process rate, jobs/s, median (lowest–highest) over repeats\n")
    print("| system | PxC | meaning | process |")
    print("| --- | ---: | --- | ---: |")
    for system in systems:
        for config, rates in process[system].items():
            mark = " (best)" if config == best[system] else ""
            figure = f"{statistics.median(rates):,.0f} ({min(rates):,.0f}–{max(rates):,.0f})"
            print(f"| {NAMES[system]} | {config}{mark} | {CONFIG_MEANING[system]} | {figure} |")


def peer(name: str, rest: list[str], args: argparse.Namespace) -> None:
    if name == "procrastinate-worker":
        procrastinate_worker(rest[0], int(rest[1]))
    elif name == "celery-worker":
        celery_worker(rest[0], int(rest[1]), int(rest[2]))
    else:
        run_one = {"telemachus": telemachus_run, "procrastinate": procrastinate_run, "celery": celery_run}[name]
        print(json.dumps(run_one(rest[0], args.jobs, getattr(args, name))))


if __name__ == "__main__":
    main()
