"""What the OpenAI-compatible endpoint adds over calling the model server directly, side by side with
LiteLLM Proxy in front of the same model server. Prints tables.

    .venv/bin/python bench/gateway.py [--requests 1000] [--concurrency 1,8,32] [--latency-ms 0,50]
                                      [--stream-concurrency 1,32] [--runs 2] [--litellm-workers 1,2]
                                      [--backend postgres|sqlite] [--redis URL] [--json FILE]
                                      [--tracing]

The same OpenAI chat request, `POST /v1/chat/completions`, is sent by C concurrent clients (asyncio,
httpx, one keep-alive connection each) three ways to the same simllm server:

  direct      straight to simllm
  LiteLLM     LiteLLM Proxy (bench/.venv-peers, never the project's .venv) run as its CLI starts
              it, `litellm --config FILE --num_workers W` (uvicorn with uvloop), once per
              --litellm-workers value, all measured: a config file written here lists the simllm
              models as `openai/` deployments with their `api_base`; a master key, no database, no
              Redis, no callbacks, telemetry vetoed, logging at ERROR (so no access log), nothing
              fetched from outside: the local model cost map and every other bundled file (LITELLM_LOCAL_*)
  Telemachus  the ASGI app served as bin/run serves it (telemachus/serve.py: TELEMACHUS_SERVER,
              uvicorn unless it says daphne), one `scheduler_worker`, one local-model executor
              per simllm server, no cap binding

in alternating blocks (the order rotating from block to block) so drift in the machine hits every
way alike. Each simllm answers after its --latency-ms (every value is a server of its own, all
running at once), 16 tokens, instant; the streaming ones send their first chunk after that and 16
more at 100 tokens/s. --runs times over, each run on fresh processes (LiteLLM, daphne, the worker,
simllm) and an emptied job table, analyzed (ANALYZE) after each warm-up as autovacuum keeps a live
system's tables: plans made for the emptied table scan all of it (`analyze` says why).

Measured, for each way, model latency and number of clients:
  latency p50 / p99 (the added time is the difference to direct), throughput (requests over the
  blocks' wall time), CPU per call: user + system time of the gateway's own processes and their
  children from /proc, read before and after each block (LiteLLM: its CLI process and uvicorn's
  workers; Telemachus: daphne and the worker, and separately the PostgreSQL server processes of
  its connections; simllm and the clients are not counted); time to first streamed token p50 /
  p99 at each --stream-concurrency; and where Telemachus's added time goes, from the jobs' own
  timestamps, all on this host's clock: client send -> job submitted (authentication, body checks,
  the submit's reads up to its transaction), submitted -> started (the submit's transaction, the
  worker's wake-up, the claim), started -> finished (the model call and the finish), finished ->
  client has the answer (the notification to the API process, its read of the job, the response).

The first table gives, per run (a range when --runs > 1), LiteLLM's best configuration for each
measure (the fewest added milliseconds, the most requests per second: which --num_workers gave it
is in brackets) and Telemachus / LiteLLM measured in the same run; the tables after it give every
LiteLLM configuration and the phases.

With --tracing, a fourth way, `telemachus-traced`: a second API process of the same stack whose
OpenTelemetry traces are on (OTEL_EXPORTER_OTLP_ENDPOINT), exporting over OTLP/HTTP to a local
receiver that keeps nothing (bench/otlpsink.py; its CPU is not counted), in the same alternating
blocks as the untraced API process. The worker traces too (a call that the API process leaves to
it is traced there; an untraced call's job keeps no trace context, so the worker records nothing
for it); its CPU counts for whichever way's block is running, as the database's does. A table then
gives what tracing adds: p50 latency, CPU per call, req/s, with tracing off and on.

Everything runs on this machine: the clients, the gateways, simllm and the database share its
cores. PostgreSQL runs in a scratch database `telemachus_bench_gateway` (created, dropped);
--backend sqlite uses a file in a temporary directory. Output deltas cross from the worker to the
API process through NOTIFY on PostgreSQL, or through Redis with --redis (on SQLite without Redis a
stream's text arrives at the end, so the time to first token needs --redis there).
"""

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import (
    cpu_seconds,
    cpu_used,
    peers_python,
    percentile,
    pg_backends,
    pg_database,
    pg_url,
    process_tree,
)

ROOT = Path(__file__).resolve().parent.parent
# Another name (BENCH_GATEWAY_DB) lets two checkouts run it at once on one server.
PG_BENCH_DB = os.environ.get("BENCH_GATEWAY_DB", "telemachus_bench_gateway")
BODY = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
BLOCKS = 4  # alternations of the ways per model latency and concurrency
LITELLM_KEY = "sk-bench-only"
# LiteLLM reads these from its environment: none of the stack's may reach it (a DATABASE_URL would
# give it a database to migrate and write spend logs to).
NOT_FOR_LITELLM = ("DATABASE_URL", "DIRECT_URL", "REDIS_URL", "REDIS_HOST", "LITELLM_MASTER_KEY")
LITELLM_ENV = {
    # The bundled copies instead of fetching them from the project's site at start-up.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_MODE": "PRODUCTION",  # reads no .env file
    "LITELLM_LOG": "ERROR",  # and uvicorn's log level with it: no access log
    "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
    "LITELLM_TELEMETRY_DISABLED": "True",  # the veto: no attempt logger, no exporter
}


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


def wait_idle(pids: list[int], timeout: float = 90) -> None:
    """Until the processes (and their children) stop burning CPU: a server answering its health
    check may still be starting other workers."""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        before = cpu_seconds(process_tree(pids))
        time.sleep(0.5)
        quiet = quiet + 1 if cpu_used(before, cpu_seconds(process_tree(pids))) < 0.05 else 0


def model(kind: str, latency: int) -> str:
    """The model name of the simllm server of that kind ("m" plain, "s" streaming) and latency."""
    return f"{kind}{latency}"


class Stack:
    """The simllm servers (one plain and one streaming for each model latency), a worker and daphne
    against one database, stopped together."""

    def __init__(self, env: dict[str, str], latencies: list[int], *, tracing: bool = False) -> None:
        self.env = env
        self.procs: list[subprocess.Popen] = []
        self.traced_api, self.sink = "", ""
        self.traced_servers: list[subprocess.Popen] = []
        # Every simllm server by model name.
        self.models: dict[str, str] = {}
        for latency in latencies:
            for kind, tokens_per_s in (("m", "0"), ("s", "100")):
                port = free_port()
                self.spawn(
                    "manage.py",
                    "simllm",
                    "--port",
                    str(port),
                    "--latency-ms",
                    str(latency),
                    "--models",
                    model(kind, latency),
                    "--output-tokens",
                    "16",
                    "--tokens-per-s",
                    tokens_per_s,
                )
                self.models[model(kind, latency)] = f"http://127.0.0.1:{port}"
        for name, base in self.models.items():
            wait_http(f"{base}/v1/models", f"simllm ({name})")
        traced: dict[str, str] = {}
        if tracing:
            port = free_port()
            self.spawn(str(ROOT / "bench/otlpsink.py"), str(port))
            self.sink = f"http://127.0.0.1:{port}"
            wait_http(self.sink, "the OTLP sink")
            traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": self.sink, "OTEL_SERVICE_NAME": "bench"}
        # Telemachus's own processes: their CPU is what a call costs it.
        first = len(self.procs)
        self.spawn("manage.py", "scheduler_worker", "--concurrency", "256", "--name", "bench", **traced)
        port = free_port()
        self.spawn("-m", "telemachus.serve", "127.0.0.1", str(port))
        self.servers = self.procs[first:]
        self.api = f"http://127.0.0.1:{port}"
        wait_http(f"{self.api}/v1/models", "the API server")
        if tracing:
            port = free_port()
            self.spawn("-m", "telemachus.serve", "127.0.0.1", str(port), **traced)
            # The traced way's processes: the shared worker and its own API process.
            self.traced_servers = [self.servers[0], self.procs[-1]]
            self.traced_api = f"http://127.0.0.1:{port}"
            wait_http(f"{self.traced_api}/v1/models", "the traced API server")

    def spawn(self, *argv: str, **env: str) -> None:
        self.procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                cwd=ROOT,
                env={**self.env, **env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def stop(self) -> None:
        stop(self.procs)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LiteLLM:
    """LiteLLM Proxy with `workers` uvicorn workers in front of the stack's simllm servers."""

    def __init__(self, python: str, workers: int, models: dict[str, str], scratch: Path) -> None:
        self.workers = workers
        config = scratch / f"litellm-{workers}.yaml"
        config.write_text(litellm_config(models))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in NOT_FOR_LITELLM} | LITELLM_ENV
        self.log = scratch / f"litellm-{workers}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    str(Path(python).parent / "litellm"),
                    "--config",
                    str(config),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--num_workers",
                    str(workers),
                ],
                cwd=scratch,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{self.url}/health/liveliness", f"LiteLLM ({workers} workers)", timeout=180)
        except SystemExit:
            sys.stderr.write(self.log.read_text()[-4000:])
            raise
        wait_idle([self.proc.pid])


def litellm_config(models: dict[str, str]) -> str:
    """LiteLLM's config file, written as JSON (a subset of YAML): each simllm model as an
    OpenAI-compatible deployment at its api_base, a master key, and no database."""
    config = {
        "model_list": [
            {
                "model_name": name,
                "litellm_params": {"model": f"openai/{name}", "api_base": f"{base}/v1", "api_key": "none"},
            }
            for name, base in models.items()
        ],
        "litellm_settings": {"set_verbose": False, "request_timeout": 600, "telemetry": False},
        "general_settings": {"master_key": LITELLM_KEY, "disable_spend_logs": True, "disable_error_logs": True},
    }
    return json.dumps(config, indent=2)


def seed(models: dict[str, str]) -> str:
    """A team, its member and API token, and an executor for each simllm server."""
    from django.contrib.auth import get_user_model

    from executors.models import Executor
    from telemachus.keys.services import personal_token_issue
    from telemachus.teams.services import team_create, team_member_set

    user, created = get_user_model().objects.get_or_create(username="bench")
    if created:
        team_member_set(team=team_create(slug="bench", name="bench"), username="bench", role="member")
    for name, base in models.items():
        Executor.objects.update_or_create(
            name=name,
            defaults={
                "kind": "local-model",
                "endpoint": f"{base}/v1",
                "capabilities": {"models": [name]},
                "max_concurrency": 100_000,
            },
        )
    return personal_token_issue(user=user)[1]


@dataclass
class Way:
    """One way to the model servers: where to send a model's requests, and whose CPU to count."""

    name: str
    url: Callable[[str], str]
    headers: dict[str, str] = field(default_factory=dict)
    servers: list[int] = field(default_factory=list)
    database: str | None = None

    def cpu(self) -> tuple[dict[int, float], dict[int, float]]:
        return (
            cpu_seconds(process_tree(self.servers)) if self.servers else {},
            cpu_seconds(pg_backends(self.database)) if self.database else {},
        )


async def load(
    url: str, body: dict, *, concurrency: int, total: int, headers: dict[str, str], stream: bool = False
) -> tuple[list[tuple[float, float, float, int | None, int]], float]:
    """`total` requests from `concurrency` clients: (sent at, answered at, latency or time to first
    token in ms, job id, chunks with text) each, on the wall clock (time.time) so they line up with the job's stamps;
    and the seconds they took together. The clients are made before the clock starts: making one
    (its TLS context) blocks the event loop for milliseconds, which would land on the requests of
    the clients already sending."""
    import httpx

    results: list[tuple[float, float, float, int | None, int]] = []
    left = total

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            sent, started = time.time(), time.perf_counter()
            if stream:
                async with http.stream("POST", url, json={**body, "stream": True}, headers=headers) as response:
                    response.raise_for_status()
                    first = None
                    chunks = 0
                    async for line in response.aiter_lines():
                        if has_content(line):
                            chunks += 1
                            if first is None:
                                first = (time.perf_counter() - started) * 1000
                if first is None:  # a stream without text has no first token to time
                    raise RuntimeError(f"{url}: a streamed answer without content")
                results.append((sent, time.time(), first, _job(response), chunks))
            else:
                response = await http.post(url, json=body, headers=headers)
                response.raise_for_status()
                results.append((sent, time.time(), (time.perf_counter() - started) * 1000, _job(response), 1))

    clients = [httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1)) for _ in range(concurrency)]
    try:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for http in clients))
        return results, time.perf_counter() - started
    finally:
        for http in clients:
            await http.aclose()


def has_content(line: str) -> bool:
    """Whether an SSE line is a chunk carrying text (not the role-only first chunk some servers
    send, nor [DONE]), whatever the server's JSON spacing."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[6:]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def _job(response) -> int | None:
    job = response.headers.get("x-telemachus-job")
    return int(job) if job else None


def phases(results: list[tuple[float, float, float, int | None, int]]) -> dict[str, float]:
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
    for sent, answered, _, job, _ in results:
        if job not in stamps:
            continue
        sub, start, end = (stamp.timestamp() for stamp in stamps[job])
        for name, value in zip(parts, (sub - sent, start - sub, end - start, answered - end), strict=True):
            parts[name].append(value * 1000)
    return {name: percentile(values, 0.5) for name, values in parts.items() if values}


async def blocks(ways: list[Way], body: dict, *, concurrency: int, total: int, stream: bool) -> dict:
    """BLOCKS alternations of `total` requests through each way, the order rotating: per way its
    latency (or time to first token) p50 / p99, requests per second over its blocks' wall time,
    and its CPU per call in ms (its servers, and its database's server processes)."""
    rows: dict[str, list] = {way.name: [] for way in ways}
    spent = {way.name: [0.0, 0.0, 0.0] for way in ways}  # wall, servers' CPU, database's CPU
    for turn in range(BLOCKS):
        for way in ways[turn % len(ways) :] + ways[: turn % len(ways)]:
            servers, database = way.cpu()
            results, wall = await load(
                way.url(body["model"]), body, concurrency=concurrency, total=total, headers=way.headers, stream=stream
            )
            rows[way.name] += results
            servers_after, database_after = way.cpu()
            for i, value in enumerate((wall, cpu_used(servers, servers_after), cpu_used(database, database_after))):
                spent[way.name][i] += value
    out: dict = {}
    for way in ways:
        timings = [r[2] for r in rows[way.name]]
        wall, servers_cpu, database_cpu = spent[way.name]
        n = len(timings)
        out[way.name] = {
            "n": n,
            "p50": percentile(timings, 0.5),
            "p99": percentile(timings, 0.99),
            "rps": n / wall,
            "cpu_ms": 1000 * servers_cpu / n if way.servers else None,
            "db_cpu_ms": 1000 * database_cpu / n if way.database else None,
            # The fewest text chunks in one answer: at 1 the first token is the whole answer.
            "min_chunks": min(r[4] for r in rows[way.name]),
        }
        if way.name == "telemachus" and not stream:
            out[way.name]["phases"] = await asyncio.to_thread(phases, rows[way.name])
    return out


def analyze() -> None:
    """Statistics for the tables as the warm-up left them, as autovacuum keeps them on a live
    system (within its naptime, a minute). The run starts on an emptied job table, analyzed empty
    (throughput.clear): PostgreSQL plans the statements that each connection has prepared for a
    table of no rows (a sequential scan of the job table) and keeps those plans until its statistics
    change, so without this the first minute of blocks would measure plans no live system runs,
    whose cost grows with every job the run adds (four scans of the whole job table per call)."""
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")


async def measure(ways: list[Way], latencies: list[int], args: argparse.Namespace) -> dict:
    out: dict = {"calls": [], "ttft": []}
    for latency in latencies:
        for kind, key, concurrencies, requests in (
            ("m", "calls", args.concurrency, args.requests),
            ("s", "ttft", args.stream_concurrency, args.requests // 4),
        ):
            if not concurrencies:  # --stream-concurrency '': no streaming at all, not even its warm-up
                continue
            body = {**BODY, "model": model(kind, latency)}
            stream = kind == "s"
            for way in ways:  # warm up: connections, first-use caches, the worker's driver
                await load(way.url(body["model"]), body, concurrency=8, total=80, headers=way.headers, stream=stream)
            await asyncio.to_thread(analyze)
            for concurrency in concurrencies:
                block = max(concurrency, requests // BLOCKS)
                by_way = await blocks(ways, body, concurrency=concurrency, total=block, stream=stream)
                out[key].append({"latency": latency, "concurrency": concurrency, "ways": by_way})
                print(f"  {key}, {latency} ms, {concurrency} clients: " + summary(by_way, stream), file=sys.stderr)
    return out


def summary(by_way: dict, stream: bool) -> str:
    return ", ".join(
        f"{name} p50 {row['p50']:.1f} p99 {row['p99']:.1f} ms"
        + (f" (at least {row['min_chunks']} text chunks)" if stream else "")
        for name, row in by_way.items()
    )


def run_once(args: argparse.Namespace, env: dict[str, str], peers: str | None, scratch: Path) -> dict:
    """One run: fresh simllm servers, Telemachus processes and LiteLLM proxies over the database
    that `env` names, emptied of the previous run's jobs."""
    import throughput

    throughput.clear()
    stack = Stack(env, args.latency_ms, tracing=args.tracing)
    proxies: list[LiteLLM] = []
    try:
        token = seed(stack.models)
        ways = [Way("direct", lambda name: f"{stack.models[name]}/v1/chat/completions")]
        for workers in args.litellm_workers:
            assert peers is not None
            proxy = LiteLLM(peers, workers, stack.models, scratch)
            proxies.append(proxy)
            ways.append(
                Way(
                    f"litellm-{workers}",
                    lambda name, url=proxy.url: f"{url}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {LITELLM_KEY}"},
                    servers=[proxy.proc.pid],
                )
            )
        ways.append(
            Way(
                "telemachus",
                lambda name: f"{stack.api}/v1/chat/completions",
                headers={"Authorization": f"Bearer {token}"},
                servers=[proc.pid for proc in stack.servers],
                database=PG_BENCH_DB if args.backend == "postgres" else None,
            )
        )
        if args.tracing:
            ways.append(
                Way(
                    "telemachus-traced",
                    lambda name: f"{stack.traced_api}/v1/chat/completions",
                    headers={"Authorization": f"Bearer {token}"},
                    servers=[proc.pid for proc in stack.traced_servers],
                    database=PG_BENCH_DB if args.backend == "postgres" else None,
                )
            )
        wait_idle([proc.pid for proc in stack.procs])
        measured = asyncio.run(measure(ways, args.latency_ms, args))
        if args.tracing:
            time.sleep(1)  # the last batch of spans leaves within OTEL_BSP_SCHEDULE_DELAY (5 s by default)
            with urllib.request.urlopen(stack.sink, timeout=5) as answer:
                measured["sink"] = json.loads(answer.read())
            print(f"  the OTLP sink received {measured['sink']}", file=sys.stderr)
        return measured
    finally:
        stop([proxy.proc for proxy in proxies])
        stack.stop()


def run(database_url: str, args: argparse.Namespace) -> list[dict]:
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
    peers = peers_python(args.peers_python) if args.litellm_workers else None
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(args.runs):
            print(f"run {number + 1} of {args.runs}", file=sys.stderr)
            runs.append(run_once(args, env, peers, Path(scratch)))
    return runs


def integers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--requests", type=int, default=1000, help="timed requests per way, latency and concurrency (streamed: 1/4)"
    )
    parser.add_argument("--concurrency", type=integers, default=[1, 8, 32])
    parser.add_argument(
        "--stream-concurrency", type=integers, default=[1, 32], help="clients for the first token; '' no streaming"
    )
    parser.add_argument("--latency-ms", type=integers, default=[0, 50], help="simllm's times to answer")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--litellm-workers", type=integers, default=[1, 2], help="LiteLLM --num_workers values, each a peer; '' none"
    )
    parser.add_argument("--peers-python", help="python of an environment with bench/requirements.txt installed")
    parser.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--redis", default="", help="REDIS_URL for the stack (output deltas through Redis)")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument(
        "--tracing", action="store_true", help="also a traced API process (OTLP to a local sink), against the untraced"
    )
    args = parser.parse_args()
    if args.backend == "postgres":
        pg_database(PG_BENCH_DB, "create")
        try:
            runs = run(pg_url(PG_BENCH_DB), args)
        finally:
            from django.db import connections

            connections.close_all()
            pg_database(PG_BENCH_DB, "drop")
    else:
        with tempfile.TemporaryDirectory() as scratch:
            runs = run(f"sqlite:///{scratch}/bench.sqlite3", args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    report(runs, args)


# --- the tables ----------------------------------------------------------------------------------


def span(values: list[float], digits: int = 1) -> str:
    """One run's figure, or the lowest to the highest of the runs'."""
    low, high = (f"{value:,.{digits}f}" for value in (min(values), max(values)))
    return low if low == high else f"{low}–{high}"


def ratio(ours: list[float], theirs: list[float]) -> str:
    """Telemachus / LiteLLM within each run; '–' where LiteLLM's figure is not above zero."""
    if any(t <= 0 for t in theirs):
        return "–"
    return span([o / t for o, t in zip(ours, theirs, strict=True)], 2)


def figures(runs: list[dict], key: str, latency: int, concurrency: int) -> list[dict]:
    """The ways' figures at that model latency and concurrency, one dict per run."""
    return [
        next(row["ways"] for row in run[key] if row["latency"] == latency and row["concurrency"] == concurrency)
        for run in runs
    ]


def report(runs: list[dict], args: argparse.Namespace) -> None:
    """One table of what matters, LiteLLM at its best per measure, with Telemachus / LiteLLM; then
    each LiteLLM configuration; then where Telemachus's time goes."""
    proxies = [f"litellm-{w}" for w in args.litellm_workers]
    transport = "Redis" if args.redis else ("NOTIFY" if args.backend == "postgres" else "none (text at the end)")
    print(
        f"\n{args.backend}, deltas through {transport}; {len(runs)} run(s), "
        f"{args.requests} requests per way and point "
        f"({f'{args.requests // 4} streamed' if args.stream_concurrency else 'no streaming'}); "
        "a range is the lowest to the highest run\n"
    )
    best_mark = "LiteLLM best (--num_workers)" if proxies else "LiteLLM (not run)"
    print(f"| model ms | measure | clients | direct (its own) | {best_mark} | Telemachus | Telemachus / LiteLLM |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")

    def line(latency: int, measure: str, clients: int, rows: list[dict], get, *, higher: bool, direct=None) -> None:
        """`get(row, way)` -> the figure; LiteLLM's best is the lowest, or with `higher` the
        highest, of its configurations within each run. `direct(row)`: the direct calls' own
        figure for that column (their latency where the row is what a gateway adds)."""
        ours = [get(row, "telemachus") for row in rows]
        cells = [span([direct(row) for row in rows]) if direct else "", "–", span(ours), "–"]
        if proxies:
            best = []
            for row in rows:
                choice = (max if higher else min)(proxies, key=lambda p, row=row: get(row, p))
                best.append((get(row, choice), choice.split("-")[1]))
            marks = ",".join(sorted({w for _, w in best}))
            cells[1] = f"{span([v for v, _ in best])} ({marks})"
            cells[3] = ratio(ours, [v for v, _ in best])
        print(f"| {latency} | {measure} | {clients} | " + " | ".join(cells) + " |")

    def added(q: str):
        return lambda row, way: row[way][q] - row["direct"][q]

    def raw(q: str):
        return lambda row: row["direct"][q]

    def cpu(row: dict, way: str) -> float:
        return row[way]["cpu_ms"] + (row[way]["db_cpu_ms"] or 0)

    for latency in args.latency_ms:
        for q in ("p50", "p99"):
            for c in args.concurrency:
                rows = figures(runs, "calls", latency, c)
                line(latency, f"added {q}, ms", c, rows, added(q), higher=False, direct=raw(q))
        top = max(args.concurrency)
        rows = figures(runs, "calls", latency, top)
        line(latency, "throughput, req/s", top, rows, lambda row, way: row[way]["rps"], higher=True, direct=raw("rps"))
        for q in ("p50", "p99"):
            for c in args.stream_concurrency:
                rows = figures(runs, "ttft", latency, c)
                line(latency, f"added first token {q}, ms", c, rows, added(q), higher=False, direct=raw(q))
        for c in args.concurrency:
            rows = figures(runs, "calls", latency, c)
            line(latency, "CPU per call (with its database), ms", c, rows, cpu, higher=False)
    if args.backend == "postgres":
        print("\nTelemachus's CPU per call includes its PostgreSQL server processes; without them:\n")
        print("| model ms | clients | Telemachus's processes | PostgreSQL |")
        print("| ---: | ---: | ---: | ---: |")
        for latency in args.latency_ms:
            for c in args.concurrency:
                rows = [row["telemachus"] for row in figures(runs, "calls", latency, c)]
                own, database = span([r["cpu_ms"] for r in rows]), span([r["db_cpu_ms"] for r in rows])
                print(f"| {latency} | {c} | {own} | {database} |")

    if proxies:
        print("\nEach LiteLLM configuration (added ms over direct; req/s and CPU ms per call)\n")
        header = " | ".join(f"{w} workers" for w in args.litellm_workers)
        print(f"| model ms | measure | clients | {header} |")
        print("| ---: | --- | ---: |" + " ---: |" * len(proxies))
        for latency in args.latency_ms:
            for key, measure, q, concurrencies in (
                ("calls", "added p50", "p50", args.concurrency),
                ("calls", "added p99", "p99", args.concurrency),
                ("calls", "throughput", "rps", args.concurrency),
                ("calls", "CPU per call", "cpu_ms", args.concurrency),
                ("ttft", "added first token p50", "p50", args.stream_concurrency),
                ("ttft", "added first token p99", "p99", args.stream_concurrency),
            ):
                for c in concurrencies:
                    rows = figures(runs, key, latency, c)
                    base = q in ("p50", "p99")
                    cells = [span([row[p][q] - (row["direct"][q] if base else 0) for row in rows]) for p in proxies]
                    print(f"| {latency} | {measure} | {c} | " + " | ".join(cells) + " |")

    if args.tracing:
        tracing_report(runs, args)

    print("\nThrough Telemachus: medians of each phase, ms (a range over runs)\n")
    names = ["send -> submitted", "submitted -> started", "started -> finished", "finished -> answered"]
    print("| model ms | clients | " + " | ".join(names) + " |")
    print("| ---: | ---: |" + " ---: |" * len(names))
    for latency in args.latency_ms:
        for c in args.concurrency:
            rows = [row["telemachus"]["phases"] for row in figures(runs, "calls", latency, c)]
            cells = [span([r[n] for r in rows if n in r]) if any(n in r for r in rows) else "–" for n in names]
            print(f"| {latency} | {c} | " + " | ".join(cells) + " |")


def tracing_report(runs: list[dict], args: argparse.Namespace) -> None:
    """What OpenTelemetry tracing adds to a call: the traced API process against the untraced one,
    in the same alternating blocks (CPU per call with the shared worker and the database)."""
    print("\nTracing off / on (OTLP/HTTP to a local sink), same run: p50 and CPU per call in ms\n")
    print("| model ms | clients | p50 off | p50 on | added p50 | CPU off | CPU on | added CPU | req/s off | req/s on |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

    def cpu(row: dict) -> float:
        return row["cpu_ms"] + (row["db_cpu_ms"] or 0)

    for latency in args.latency_ms:
        for c in args.concurrency:
            rows = figures(runs, "calls", latency, c)
            off, on = [row["telemachus"] for row in rows], [row["telemachus-traced"] for row in rows]
            cells = [
                span([r["p50"] for r in off]),
                span([r["p50"] for r in on]),
                span([b["p50"] - a["p50"] for a, b in zip(off, on, strict=True)], 2),
                span([cpu(r) for r in off], 2),
                span([cpu(r) for r in on], 2),
                span([cpu(b) - cpu(a) for a, b in zip(off, on, strict=True)], 2),
                span([r["rps"] for r in off]),
                span([r["rps"] for r in on]),
            ]
            print(f"| {latency} | {c} | " + " | ".join(cells) + " |")
    exported = [f"{run['sink']['exports']} exports, {run['sink']['bytes']:,} bytes" for run in runs]
    print("\nSpans exported, per run: " + "; ".join(exported))


if __name__ == "__main__":
    main()
