"""Batches on the durable queue (docs/batches.md): ingestion, live calls beside a running batch, and
the batch's use of the capacity left over. Prints a table.

    .venv/bin/python bench/batches.py [--lines 50000] [--batch 10000] [--live 200] [--latency-ms 20]
                                      [--slots 8] [--workers 2] [--peers-python PY] [--json FILE]

Everything runs on this machine, against a scratch PostgreSQL database (`telemachus_bench_batches`,
created and dropped): the API server as bin/run serves it (telemachus/serve.py), `scheduler_worker`
processes, one simllm model server answering after --latency-ms, one local-model executor of
--slots slots on it, the default queue policy (batch_share 0.75).

  ingestion   a JSONL file of --lines chat requests uploaded with the official `openai` SDK
              (`files.create`, multipart, streamed to storage) and made a batch (`batches.create`:
              every line read back a chunk at a time, checked and stored), with no worker running,
              so nothing else competes. Lines/s of upload + create, of the create alone, and the API
              process's peak resident memory (VmHWM) against its memory before the upload. Beside
              it, in the same run, Procrastinate (bench/.venv-peers) deferring as many no-op jobs
              with `batch_defer_async` in bulks of 1,000 (jobs/s), and Telemachus's `jobs_submit`
              in bulks of 1,000 (jobs/s). The ingested batch is then cancelled.
  live calls  --live chat completions, one after another, through the SDK: first with no batch,
              then while a batch of --batch lines runs on the same executor (after it holds its
              share of the slots): p50 and p99 of each and their ratio.
  throughput  the batch's lines per second while the live calls ran and after, against what the
              slots left over allow: min(batch share, slots - live calls in flight) / the lines'
              median time on the executor (their jobs' started -> finished).
"""

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
PG_BENCH_DB = "telemachus_bench_batches"
BULK = 1000

from benchlib import peers_python, percentile, pg_database, pg_url  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not answer within {timeout}s")


def memory_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def request_lines(n: int, model: str) -> bytes:
    line = {
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": "Summarize this line."}], "max_tokens": 8},
    }
    return b"".join(json.dumps({"custom_id": f"line-{i}", **line}).encode() + b"\n" for i in range(n))


class Stack:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def spawn(self, *argv: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def procrastinate_ingest(database_url: str, jobs: int) -> float:
    """Run in bench/.venv-peers: Procrastinate's `batch_defer_async` of `jobs` no-op jobs in bulks."""
    import procrastinate
    import psycopg

    conninfo = database_url.replace("postgres://", "postgresql://")
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo))

    @app.task(name="noop")
    async def noop() -> None:
        pass

    async def main() -> float:
        async with app.open_async():
            with psycopg.connect(conninfo, autocommit=True) as conn:
                if conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0] is None:
                    await app.schema_manager.apply_schema_async()
                conn.execute("TRUNCATE procrastinate_jobs CASCADE")
            started = time.perf_counter()
            for _ in range(jobs // BULK):
                await noop.batch_defer_async(*([{}] * BULK))
            return jobs / (time.perf_counter() - started)

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--live", type=int, default=200)
    parser.add_argument("--latency-ms", type=int, default=20)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--peers-python", help="python of an environment with bench/requirements.txt installed")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--peer", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.peer == "procrastinate":
        print(json.dumps(procrastinate_ingest(rest[0], int(rest[1]))))
        return
    database_url = pg_url(PG_BENCH_DB)
    pg_database(PG_BENCH_DB, "create")
    try:
        results = run(args, database_url)
    finally:
        from django.db import connections

        connections.close_all()
        pg_database(PG_BENCH_DB, "drop")
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def run(args: argparse.Namespace, database_url: str) -> dict:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "telemachus.settings",
        "LOG_LEVEL": "WARNING",
        "DEBUG": "0",
        "SECRET_KEY": "bench-only-secret-key-" + "x" * 40,
        "SECURE_SSL_REDIRECT": "0",
        "TELEMACHUS_OPENAI_RATE": "",
        "TELEMACHUS_SUBMIT_RATE": "",
        "TELEMACHUS_PROBE_INTERVAL_SECONDS": "3600",
        "TELEMACHUS_BATCH_FEED_SECONDS": "0.05",
    }
    os.environ.update(env)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission
    from django.core.management import call_command

    from executors.models import Executor
    from scheduler.models import Job
    from scheduler.services.submit import JobSpec, jobs_submit
    from telemachus.keys.digests import TOKEN_MARKER, secret_digest, secret_new, secret_prefix
    from telemachus.keys.models import PersonalToken
    from telemachus.models import Team
    from telemachus.teams import rbac
    from telemachus.teams.services import team_create, team_member_set

    call_command("migrate", verbosity=0)
    user = get_user_model().objects.create_user("bench")
    user.user_permissions.add(Permission.objects.get(codename=rbac.PERMISSIONS[rbac.CHAT]))
    team_create(slug="bench", name="bench", grants=tuple(rbac.PERMISSIONS))
    team_member_set(team=Team.objects.get(slug="bench"), username="bench", role="member")
    secret = secret_new(TOKEN_MARKER)
    PersonalToken.objects.create(user=user, name="bench", prefix=secret_prefix(secret), digest=secret_digest(secret))

    from openai import OpenAI

    stack = Stack(env)
    results: dict = {"lines": args.lines, "batch": args.batch, "latency_ms": args.latency_ms, "slots": args.slots}
    try:
        sim_port = free_port()
        stack.spawn(
            "manage.py", "simllm", "--port", str(sim_port), "--latency-ms", str(args.latency_ms), "--models", "m"
        )
        Executor.objects.create(
            name="x",
            kind="local-model",
            endpoint=f"http://127.0.0.1:{sim_port}/v1",
            capabilities={"models": ["m"]},
            max_concurrency=args.slots,
        )
        api_port = free_port()
        api = stack.spawn("-m", "telemachus.serve", "127.0.0.1", str(api_port))
        base = f"http://127.0.0.1:{api_port}"
        wait_http(f"http://127.0.0.1:{sim_port}/v1/models", "simllm")
        wait_http(f"{base}/v1/models", "the API server")
        client = OpenAI(api_key=secret, base_url=f"{base}/v1", max_retries=0, timeout=600)
        client.models.list()

        # Ingestion, nothing else running.
        data = request_lines(args.lines, "m")
        rss_before = memory_kb(api.pid, "VmRSS")
        started = time.perf_counter()
        uploaded = client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
        uploaded_at = time.perf_counter()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        created_at = time.perf_counter()
        assert batch.status == "in_progress", batch
        results["ingest"] = {
            "bytes": len(data),
            "lines_per_s": args.lines / (created_at - started),
            "create_lines_per_s": args.lines / (created_at - uploaded_at),
            "upload_s": uploaded_at - started,
            "create_s": created_at - uploaded_at,
            "api_rss_before_mb": rss_before / 1024,
            "api_peak_mb": memory_kb(api.pid, "VmHWM") / 1024,
        }
        client.batches.cancel(batch.id)
        specs = [
            JobSpec(
                team="bench",
                type="chat",
                requirements={"model": "m"},
                input={"messages": [{"role": "user", "content": "x"}]},
            )
            for _ in range(BULK)
        ]
        bulk_started = time.perf_counter()
        for _ in range(10):
            jobs_submit(user=user, jobs=specs)
        results["ingest"]["jobs_submit_per_s"] = 10 * BULK / (time.perf_counter() - bulk_started)
        Job.objects.filter(batch__isnull=True).delete()
        peers = peers_python(args.peers_python)
        out = subprocess.run(
            [peers, __file__, "--peer", "procrastinate", database_url, str(args.lines)],
            capture_output=True,
            text=True,
            check=True,
        )
        results["ingest"]["procrastinate_per_s"] = json.loads(out.stdout.strip().splitlines()[-1])

        for i in range(args.workers):
            stack.spawn("manage.py", "scheduler_worker", "--concurrency", "64", "--name", f"w{i}")
        hello = [{"role": "user", "content": "hello"}]

        def live_calls() -> list[float]:
            times = []
            for _ in range(args.live):
                t = time.perf_counter()
                client.chat.completions.create(model="m", messages=hello, max_tokens=8)
                times.append(time.perf_counter() - t)
            return times

        live_calls()  # warm-up
        alone = live_calls()
        uploaded = client.files.create(
            file=("batch.jsonl", io.BytesIO(request_lines(args.batch, "m"))), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        share = int(args.slots * 0.75)
        from scheduler.models import Slot

        deadline = time.monotonic() + 60
        while Slot.objects.filter(batch=True).count() < share and time.monotonic() < deadline:
            time.sleep(0.05)
        beside_started = time.perf_counter()
        done_before = Job.objects.filter(batch_id=batch.id, status="done").count()
        beside = live_calls()
        beside_s = time.perf_counter() - beside_started
        done_during = Job.objects.filter(batch_id=batch.id, status="done").count() - done_before
        while client.batches.retrieve(batch.id).status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.5)
        final = client.batches.retrieve(batch.id)
        lines = Job.objects.filter(batch_id=batch.id, status="done")
        spans = [(j.finished_at - j.started_at).total_seconds() for j in lines.only("started_at", "finished_at")]
        first = min(j.started_at for j in lines.only("started_at"))
        last = max(j.finished_at for j in lines.only("finished_at"))
        per_line = statistics.median(spans)
        # The live calls run one at a time: they hold at most one slot.
        leftover = min(share, args.slots - 1) / per_line
        after_rate = final.request_counts.completed / (last - first).total_seconds()
        results["live"] = {
            "alone_p50_ms": percentile(alone, 0.5) * 1000,
            "alone_p99_ms": percentile(alone, 0.99) * 1000,
            "beside_p50_ms": percentile(beside, 0.5) * 1000,
            "beside_p99_ms": percentile(beside, 0.99) * 1000,
        }
        results["throughput"] = {
            "lines_per_s_during_live": done_during / beside_s,
            "lines_per_s_whole_batch": after_rate,
            "line_median_ms": per_line * 1000,
            "leftover_lines_per_s": leftover,
            "share_of_leftover": (done_during / beside_s) / leftover,
            "whole_batch_share_of_batch_slots": after_rate / (share / per_line),
            "completed": final.request_counts.completed,
        }
    finally:
        stack.stop()
    return results


def report(results: dict) -> None:
    ingest, live, tp = results["ingest"], results["live"], results["throughput"]
    rows = [
        f"ingestion of {results['lines']} lines ({ingest['bytes'] / 1e6:.1f} MB)",
        f"  upload + create        {ingest['lines_per_s']:>10,.0f} lines/s"
        f"  ({ingest['upload_s']:.2f} s + {ingest['create_s']:.2f} s)",
        f"  create alone           {ingest['create_lines_per_s']:>10,.0f} lines/s",
        f"  jobs_submit, bulks     {ingest['jobs_submit_per_s']:>10,.0f} jobs/s",
        f"  Procrastinate          {ingest['procrastinate_per_s']:>10,.0f} jobs/s"
        f"  (batch_defer_async, bulks of {BULK})",
        f"  API process memory     {ingest['api_rss_before_mb']:.0f} MB before, peak {ingest['api_peak_mb']:.0f} MB",
        f"live calls, one at a time, {results['latency_ms']} ms model, {results['slots']} slots",
        f"  alone                  p50 {live['alone_p50_ms']:.1f} ms  p99 {live['alone_p99_ms']:.1f} ms",
        f"  beside a {results['batch']}-line batch  p50 {live['beside_p50_ms']:.1f} ms"
        f"  p99 {live['beside_p99_ms']:.1f} ms  ({live['beside_p50_ms'] / live['alone_p50_ms']:.2f}x,"
        f" {live['beside_p99_ms'] / live['alone_p99_ms']:.2f}x)",
        "batch throughput",
        f"  during the live calls  {tp['lines_per_s_during_live']:,.0f} lines/s of"
        f" {tp['leftover_lines_per_s']:,.0f} left over ({tp['share_of_leftover']:.0%})",
        f"  whole batch            {tp['lines_per_s_whole_batch']:,.0f} lines/s"
        f" ({tp['whole_batch_share_of_batch_slots']:.0%} of its share's capacity),"
        f" line median {tp['line_median_ms']:.1f} ms",
    ]
    print("\n".join(rows))


if __name__ == "__main__":
    main()
