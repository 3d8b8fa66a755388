"""The cost of dispatching to a model server, and how many requests one worker holds in flight.
Prints tables.

    .venv/bin/python bench/dispatch.py [--requests 3000] [--concurrency 500,1000]

  (a) driver overhead: p50/p99 of `LocalModelDriver(executor).dispatch(request)` against a direct
      `httpx.AsyncClient.post` of the same body to the same simllm server (`--latency-ms 0`), and
      that post followed by `response.json()` (the driver parses the reply too). Sequential, in one
      process, in alternating blocks so drift in the machine hits all three alike.
  (b) in flight per worker: one `scheduler_worker --concurrency C` against a local-model executor
      on a simllm server answering after 2 s, with 2×C jobs queued. The peak in flight is what the
      server counted (GET /stats); memory is the worker's resident set (VmRSS): once started and
      idle, idle again after a warm-up of 20 jobs (imports, the HTTP client and first-use caches are
      per process, not per request), and the highest sampled while the jobs ran. Memory per
      in-flight request = (RSS at peak - RSS idle after warm-up) / peak in flight. CPU ms/job is
      the worker's user + system time over the run, per job.
PostgreSQL runs in a scratch database `telemachus_bench_dispatch` on 127.0.0.1 (created and dropped).
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = "telemachus_bench_dispatch"
WARM_UP_JOBS = 20
SLOW_LATENCY_MS = 2000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, method: str = "GET") -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as response:
        return json.loads(response.read())


def child_env(database_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "telemachus.settings",
        "LOG_LEVEL": "WARNING",
    }


def start_simllm(latency_ms: int, database_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "simllm", "--port", str(port), "--latency-ms", str(latency_ms), "--models", "m"],
        cwd=ROOT,
        env=child_env(database_url),
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            http_json(f"{base}/v1/models")
            return proc, base
        except OSError as error:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("simllm did not start") from error
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# --- child: (a) driver overhead ---------------------------------------------------------------


def driver_overhead(requests: int, database_url: str) -> dict:
    simllm, base = start_simllm(0, database_url)
    try:
        return asyncio.run(_overhead(base, requests))
    finally:
        stop(simllm)


async def _overhead(base: str, requests: int) -> dict:
    import httpx

    from executors.contract import DispatchRequest
    from executors.drivers.openai import LocalModelDriver
    from executors.models import Executor

    executor = Executor(name="bench", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["m"]})
    driver = LocalModelDriver(executor)
    request = DispatchRequest(
        job_id=1,
        type="chat",
        model="m",
        input={"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16},
    )
    body = driver.request_body(request)
    # The same client settings as the driver's own, so the comparison isolates the driver's work.
    direct = httpx.AsyncClient(
        base_url=f"{base}/v1",
        timeout=httpx.Timeout(120, connect=5),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
    )

    async def via_driver() -> None:
        await driver.dispatch(request)

    async def post() -> None:
        (await direct.post("/chat/completions", json=body)).raise_for_status()

    async def post_and_parse() -> None:
        response = await direct.post("/chat/completions", json=body)
        response.raise_for_status()
        response.json()

    ways = {"driver.dispatch": via_driver, "httpx post": post, "httpx post + json()": post_and_parse}
    timings: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():  # warm up: connections, first-use caches
        for _ in range(100):
            await way()
    block = 100
    for _ in range(max(1, requests // block)):
        for name, way in ways.items():
            for _ in range(block):
                started = time.perf_counter()
                await way()
                timings[name].append((time.perf_counter() - started) * 1000)
    await driver.aclose()
    await direct.aclose()
    return {name: {"n": len(t), "p50": percentile(t, 0.5), "p99": percentile(t, 0.99)} for name, t in timings.items()}


# --- child: (b) in flight per worker process --------------------------------------------------------


def seed(endpoint: str) -> tuple:
    from django.contrib.auth import get_user_model

    from executors.models import Executor
    from telemachus.teams.services import team_create, team_member_set

    user = get_user_model().objects.create_user("bench")
    team = team_create(slug="bench", name="bench")
    team_member_set(team=team, username="bench", role="member")
    # No quota policy: the worker's --concurrency is the only limit in play.
    Executor.objects.create(
        name="llm", kind="local-model", endpoint=endpoint, capabilities={"models": ["m"]}, max_concurrency=100_000
    )
    return user, team


def queue(n: int, user, team) -> None:
    from django.db import connection, transaction
    from django.utils import timezone

    from scheduler.models import Job
    from telemachus.control import notify

    now = timezone.now()
    rows = [
        Job(
            type="chat",
            user=user,
            team=team,
            requirements={"model": "m"},
            model="m",
            input={"messages": [{"role": "user", "content": f"job {i}"}], "max_tokens": 16},
            submitted_at=now,
        )
        for i in range(n)
    ]
    with transaction.atomic():
        Job.objects.bulk_create(rows, batch_size=5000)
        notify.notify_workers(notify.QUEUED)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE scheduler_job")


def wait_all_done(n: int, timeout: float) -> float:
    from scheduler.models import Job

    started = time.monotonic()
    while (done := Job.objects.filter(status__in=Job.TERMINAL).count()) < n:
        if time.monotonic() - started > timeout:
            raise SystemExit(f"only {done} of {n} jobs finished after {timeout:.0f}s")
        time.sleep(0.2)
    failed = Job.objects.exclude(status="done").count()
    if failed:
        raise SystemExit(f"{failed} jobs did not end done: {Job.objects.exclude(status='done').values('error')[:3]}")
    return time.monotonic() - started


class Sampler(threading.Thread):
    """Samples the worker's RSS every 20 ms and keeps the highest."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.stop_event = threading.Event()
        self.max_rss = 0

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.max_rss = max(self.max_rss, rss_kib(self.pid))
            self.stop_event.wait(0.02)


def in_flight(concurrency: int, setup: tuple, base: str, database_url: str) -> dict:
    from scheduler.models import Job, JobEvent, Slot

    Slot.objects.all().delete()
    JobEvent.objects.all().delete()
    Job.objects.all().delete()
    http_json(f"{base}/stats/reset", method="POST")
    worker = subprocess.Popen(
        [
            sys.executable,
            "manage.py",
            "scheduler_worker",
            "--concurrency",
            str(concurrency),
            "--name",
            f"bench-{concurrency}",
        ],
        cwd=ROOT,
        env=child_env(database_url),
    )
    try:
        time.sleep(5)  # start-up: imports, recovery, LISTEN
        rss_started = rss_kib(worker.pid)
        queue(WARM_UP_JOBS, *setup)
        wait_all_done(WARM_UP_JOBS, timeout=60)
        time.sleep(2)
        rss_warm = rss_kib(worker.pid)
        http_json(f"{base}/stats/reset", method="POST")
        sampler = Sampler(worker.pid)
        sampler.start()
        cpu_before = cpu_seconds(worker.pid)
        jobs = 2 * concurrency
        queue(jobs, *setup)
        seconds = wait_all_done(WARM_UP_JOBS + jobs, timeout=600)
        cpu = cpu_seconds(worker.pid) - cpu_before
        sampler.stop_event.set()
        sampler.join()
        stats = http_json(f"{base}/stats")
    finally:
        stop(worker)
    peak = stats["peak"]
    return {
        "concurrency": concurrency,
        "jobs": jobs,
        "seconds": seconds,
        "cpu_ms_per_job": cpu * 1000 / jobs,
        "peak": peak,
        "rss_started": rss_started,
        "rss_warm": rss_warm,
        "rss_peak": sampler.max_rss,
        "per_request_kib": (sampler.max_rss - rss_warm) / peak if peak else None,
    }


def child(database_url: str, requests: int, concurrencies: list[int]) -> dict:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "telemachus.settings")
    os.environ["LOG_LEVEL"] = "WARNING"
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    results: dict = {"overhead": driver_overhead(requests, database_url), "in_flight": []}
    simllm, base = start_simllm(SLOW_LATENCY_MS, database_url)
    try:
        setup = seed(f"{base}/v1")
        for concurrency in concurrencies:
            results["in_flight"].append(in_flight(concurrency, setup, base, database_url))
    finally:
        stop(simllm)
    return results


# --- parent: a scratch database, the child, the tables ------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per way in (a)")
    parser.add_argument("--concurrency", default="500,1000", help="worker --concurrency values for (b)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.child:
        print(json.dumps(child(args.child, args.requests, concurrencies)))
        return

    pg_database(PG_BENCH_DB, "create")
    try:
        url = pg_url(PG_BENCH_DB)
        result = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                url,
                "--requests",
                str(args.requests),
                "--concurrency",
                args.concurrency,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        pg_database(PG_BENCH_DB, "drop")
    if result.returncode != 0:
        raise SystemExit(f"benchmark failed:\n{result.stderr[-4000:]}")
    r = json.loads(result.stdout.strip().splitlines()[-1])

    print("\n(a) driver overhead: sequential chat requests to simllm --latency-ms 0, one process\n")
    print(f"{'way':<22} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, t in r["overhead"].items():
        print(f"{name:<22} {t['n']:>9} {t['p50']:>8.3f} {t['p99']:>8.3f}")
    d, p = r["overhead"]["driver.dispatch"], r["overhead"]["httpx post"]
    print(f"{'driver - post':<22} {'':>9} {d['p50'] - p['p50']:>8.3f} {d['p99'] - p['p99']:>8.3f}")

    print(f"\n(b) one worker process, simllm answering after {SLOW_LATENCY_MS} ms, 2 x concurrency jobs queued\n")
    print(
        f"{'concurrency':>11} {'jobs':>6} {'peak in flight':>15} {'drain s':>8} {'CPU ms/job':>11} "
        f"{'RSS start MiB':>14} {'RSS warm MiB':>13} {'RSS peak MiB':>13} {'KiB/in flight':>14}"
    )
    for row in r["in_flight"]:
        per = row["per_request_kib"]
        print(
            f"{row['concurrency']:>11} {row['jobs']:>6} {row['peak']:>15} {row['seconds']:>8.1f} "
            f"{row['cpu_ms_per_job']:>11.2f} "
            f"{row['rss_started'] / 1024:>14.1f} {row['rss_warm'] / 1024:>13.1f} {row['rss_peak'] / 1024:>13.1f} "
            f"{'-' if per is None else f'{per:.1f}':>14}"
        )


if __name__ == "__main__":
    main()
