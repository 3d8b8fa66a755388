"""What the OpenAI-compatible endpoint adds over calling the model server directly. Prints tables.

    .venv/bin/python bench/gateway.py [--requests 1000] [--concurrency 1,50,200] [--latency-ms 50]
                                      [--backend postgres|sqlite] [--redis URL]

The same OpenAI chat request, `POST /v1/chat/completions`, is sent by C concurrent clients (asyncio,
httpx, one keep-alive connection each) either straight to a simllm server or to Telemachus (daphne
serving the ASGI app, one `scheduler_worker`, a local-model executor on that simllm server, no cap
binding), in alternating blocks so drift in the machine hits both alike.

  (a) overhead: latency p50 / p99, direct and through Telemachus, at each concurrency; the added
      time is the difference. simllm answers after --latency-ms (default 50), 16 tokens, instant.
  (b) where the added time goes (through Telemachus, medians): from the job's own timestamps, all on
      this host's clock: client send -> job submitted (authentication, body checks, the submit's
      reads up to its transaction), submitted -> started (the submit's transaction, the worker's
      wake-up, the claim), started -> finished (the model call and the finish), finished -> client
      has the answer (the notification to the API process, its read of the job, the response).
  (c) time to first token of a streamed request (`stream: true`; simllm sends its first chunk after
      --latency-ms and 16 more at 100 tokens/s), p50 / p99, direct and through Telemachus, at
      concurrency 1 and 50.

Everything runs on this machine: the clients, daphne, the worker, simllm and the database share
its cores. PostgreSQL runs in a scratch database `telemachus_bench_gateway` (created, dropped);
--backend sqlite uses a file in a temporary directory. Output deltas cross from the worker to the
API process through NOTIFY on PostgreSQL, or through Redis with --redis (on SQLite without Redis
a stream's text arrives at the end, so (c) needs --redis there).
"""

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = "telemachus_bench_gateway"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
BLOCKS = 4  # alternations of direct and through Telemachus per concurrency


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not start") from error
            time.sleep(0.1)


class Stack:
    """simllm, a worker and daphne against one database, stopped together."""

    def __init__(self, env: dict[str, str], latency_ms: int) -> None:
        self.env = env
        self.procs: list[subprocess.Popen] = []
        port = free_port()
        self.spawn(
            "manage.py",
            "simllm",
            "--port",
            str(port),
            "--latency-ms",
            str(latency_ms),
            "--models",
            "m",
            "--output-tokens",
            "16",
            "--tokens-per-s",
            "0",
        )
        self.simllm = f"http://127.0.0.1:{port}"
        wait_http(f"{self.simllm}/v1/models", "simllm")
        port = free_port()
        self.spawn(
            "manage.py",
            "simllm",
            "--port",
            str(port),
            "--latency-ms",
            str(latency_ms),
            "--models",
            "s",
            "--output-tokens",
            "16",
            "--tokens-per-s",
            "100",
        )
        self.streaming = f"http://127.0.0.1:{port}"
        wait_http(f"{self.streaming}/v1/models", "simllm (streaming)")
        self.spawn("manage.py", "scheduler_worker", "--concurrency", "256", "--name", "bench")
        port = free_port()
        self.spawn("-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "telemachus.asgi:application")
        self.api = f"http://127.0.0.1:{port}"
        wait_http(f"{self.api}/v1/models", "daphne")

    def spawn(self, *argv: str) -> None:
        self.procs.append(
            subprocess.Popen(
                [sys.executable, *argv], cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def seed(simllm: str, streaming: str) -> str:
    """A team, its member and API token, and two executors (plain and streaming model servers)."""
    from django.contrib.auth import get_user_model

    from executors.models import Executor
    from telemachus.keys.services import personal_token_issue
    from telemachus.teams.services import team_create, team_member_set

    user = get_user_model().objects.create_user("bench")
    team_member_set(team=team_create(slug="bench", name="bench"), username="bench", role="member")
    for name, base, model in (("plain", simllm, "m"), ("streaming", streaming, "s")):
        Executor.objects.create(
            name=name,
            kind="local-model",
            endpoint=f"{base}/v1",
            capabilities={"models": [model]},
            max_concurrency=100_000,
        )
    return personal_token_issue(user=user)[1]


async def load(
    url: str, body: dict, *, concurrency: int, total: int, headers: dict[str, str], stream: bool = False
) -> list[tuple[float, float, float, int | None]]:
    """`total` requests from `concurrency` clients: (sent at, answered at, latency or time to first
    token in ms, job id) each, on the wall clock (time.time) so they line up with the job's stamps."""
    import httpx

    results: list[tuple[float, float, float, int | None]] = []
    left = total

    async def client() -> None:
        nonlocal left
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1)) as http:
            while left > 0:
                left -= 1
                sent, started = time.time(), time.perf_counter()
                if stream:
                    async with http.stream("POST", url, json={**body, "stream": True}, headers=headers) as response:
                        response.raise_for_status()
                        first = None
                        async for line in response.aiter_lines():
                            if first is None and line.startswith("data: {") and '"content": "' in line:
                                first = (time.perf_counter() - started) * 1000
                    results.append((sent, time.time(), first or 0.0, _job(response)))
                else:
                    response = await http.post(url, json=body, headers=headers)
                    response.raise_for_status()
                    results.append((sent, time.time(), (time.perf_counter() - started) * 1000, _job(response)))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


def _job(response) -> int | None:
    job = response.headers.get("x-telemachus-job")
    return int(job) if job else None


def phases(results: list[tuple[float, float, float, int | None]]) -> dict[str, float]:
    """Medians of the four phases of a call through Telemachus, from the jobs' timestamps."""
    from scheduler.models import Job

    stamps = {
        pk: (sub, start, end)
        for pk, sub, start, end in Job.objects.filter(pk__in=[r[3] for r in results if r[3]]).values_list(
            "pk", "submitted_at", "started_at", "finished_at"
        )
    }
    parts: dict[str, list[float]] = {
        "send -> submitted": [],
        "submitted -> started": [],
        "started -> finished": [],
        "finished -> answered": [],
    }
    for sent, answered, _, job in results:
        if job not in stamps:
            continue
        sub, start, end = (stamp.timestamp() for stamp in stamps[job])
        for name, value in zip(parts, (sub - sent, start - sub, end - start, answered - end), strict=True):
            parts[name].append(value * 1000)
    return {name: percentile(values, 0.5) for name, values in parts.items() if values}


async def measure(stack: Stack, token: str, concurrencies: list[int], requests: int) -> dict:
    direct = {"url": f"{stack.simllm}/v1/chat/completions", "headers": {}}
    through = {"url": f"{stack.api}/v1/chat/completions", "headers": {"Authorization": f"Bearer {token}"}}
    for way in (direct, through):  # warm up: connections, first-use caches, the worker's driver
        await load(way["url"], BODY, concurrency=10, total=200, headers=way["headers"])
    out: dict = {"overhead": [], "ttft": []}
    for concurrency in concurrencies:
        block = max(concurrency, requests // BLOCKS)
        timings: dict[str, list] = {"direct": [], "through": []}
        for _ in range(BLOCKS):
            for name, way in (("direct", direct), ("through", through)):
                timings[name] += await load(
                    way["url"], BODY, concurrency=concurrency, total=block, headers=way["headers"]
                )
        out["overhead"].append(
            {
                "concurrency": concurrency,
                "n": len(timings["through"]),
                **{
                    f"{name}_{q}": percentile([r[2] for r in rows], level)
                    for name, rows in timings.items()
                    for q, level in (("p50", 0.5), ("p99", 0.99))
                },
                "phases": await asyncio.to_thread(phases, timings["through"]),
            }
        )
    streamed = {"url": f"{stack.streaming}/v1/chat/completions", "headers": {}}
    streamed_through = {"url": f"{stack.api}/v1/chat/completions", "headers": through["headers"]}
    body = {**BODY, "model": "s"}
    for way in (streamed, streamed_through):
        await load(way["url"], body, concurrency=5, total=50, headers=way["headers"], stream=True)
    for concurrency in (1, 50):
        block = max(concurrency, requests // (2 * BLOCKS))
        timings = {"direct": [], "through": []}
        for _ in range(BLOCKS):
            for name, way in (("direct", streamed), ("through", streamed_through)):
                timings[name] += await load(
                    way["url"], body, concurrency=concurrency, total=block, headers=way["headers"], stream=True
                )
        out["ttft"].append(
            {
                "concurrency": concurrency,
                "n": len(timings["through"]),
                **{
                    f"{name}_{q}": percentile([r[2] for r in rows], level)
                    for name, rows in timings.items()
                    for q, level in (("p50", 0.5), ("p99", 0.99))
                },
            }
        )
    return out


def run(database_url: str, args: argparse.Namespace) -> dict:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "telemachus.settings",
        "LOG_LEVEL": "WARNING",
        "DEBUG": "0",
        "SECRET_KEY": "bench-only-secret-key-" + "x" * 40,
        "SECURE_SSL_REDIRECT": "0",
        "REDIS_URL": args.redis or "",
        # One token sends every request: the per-user rate of /v1/ calls would measure itself.
        "TELEMACHUS_OPENAI_RATE": "",
    }
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    stack = Stack(env, args.latency_ms)
    try:
        token = seed(stack.simllm, stack.streaming)
        return asyncio.run(measure(stack, token, [int(c) for c in args.concurrency.split(",")], args.requests))
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="timed requests per way and concurrency")
    parser.add_argument("--concurrency", default="1,50,200")
    parser.add_argument("--latency-ms", type=int, default=50, help="simllm's time to answer")
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--redis", default="", help="REDIS_URL for the stack (output deltas through Redis)")
    args = parser.parse_args()
    if args.backend == "postgres":
        pg_database(PG_BENCH_DB, "create")
        try:
            result = run(pg_url(PG_BENCH_DB), args)
        finally:
            from django.db import connections

            connections.close_all()
            pg_database(PG_BENCH_DB, "drop")
    else:
        with tempfile.TemporaryDirectory() as scratch:
            result = run(f"sqlite:///{scratch}/bench.sqlite3", args)

    transport = "Redis" if args.redis else ("NOTIFY" if args.backend == "postgres" else "none (text at the end)")
    print(f"\n{args.backend}, simllm answering after {args.latency_ms} ms; deltas through {transport}\n")
    print("(a) POST /v1/chat/completions, latency in ms\n")
    print(
        f"{'clients':>7} {'requests':>9} {'direct p50':>11} {'direct p99':>11} {'ours p50':>9} {'ours p99':>9} "
        f"{'added p50':>10} {'added p99':>10}"
    )
    for row in result["overhead"]:
        print(
            f"{row['concurrency']:>7} {row['n']:>9} {row['direct_p50']:>11.1f} {row['direct_p99']:>11.1f} "
            f"{row['through_p50']:>9.1f} {row['through_p99']:>9.1f} "
            f"{row['through_p50'] - row['direct_p50']:>10.1f} {row['through_p99'] - row['direct_p99']:>10.1f}"
        )
    print("\n(b) through Telemachus: medians of each phase, ms\n")
    names = list(result["overhead"][0]["phases"])
    print(f"{'clients':>7} " + " ".join(f"{name:>22}" for name in names))
    for row in result["overhead"]:
        print(f"{row['concurrency']:>7} " + " ".join(f"{row['phases'].get(name, 0):>22.1f}" for name in names))
    print("\n(c) time to first token, streamed, ms\n")
    print(f"{'clients':>7} {'requests':>9} {'direct p50':>11} {'direct p99':>11} {'ours p50':>9} {'ours p99':>9}")
    for row in result["ttft"]:
        print(
            f"{row['concurrency']:>7} {row['n']:>9} {row['direct_p50']:>11.1f} {row['direct_p99']:>11.1f} "
            f"{row['through_p50']:>9.1f} {row['through_p99']:>9.1f}"
        )


if __name__ == "__main__":
    main()
