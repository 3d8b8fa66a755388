"""Prefix-cache-aware placement (issue #39) on PostgreSQL with real model servers and real workers.
Prints a table.

    .venv/bin/python bench/prefix.py [--servers 3] [--slots 4] [--prefixes 8] [--calls 240]
        [--rate 30] [--latency-ms 200] [--hot 0.5]

In a scratch database `telemachus_bench_prefix` on 127.0.0.1 (BENCH_PREFIX_DB names another;
created and dropped): --servers simllm processes, each the model server of one executor of
--slots slots offering model `m`, and two `scheduler_worker --concurrency 16` processes. The
bench submits --calls chat jobs open-loop at --rate a second, each with one of --prefixes long
system prompts (about 2 KB each, then a short question of its own), and waits for them all.
Which server served each call is the executor the scheduler placed it on (each server is one
executor's). Once per placement rule: least-loaded (the default), then prefix; then again with one
prefix hot (--hot: the share of all calls that use prefix 0).

Reported per run: the share of each prefix's calls that ran on that prefix's executor (the one
that served most of them; by chance, 1 / servers), the calls per executor and the busiest
executor's count over the least busy one's, and the queue wait (started_at - submitted_at) p50
and p95. Then what placement itself costs, in process: hashing a 2 KB prompt at submit
(`prompt_prefix`) and choosing among --servers executors (`BaseQueuePolicy.place`) with prefix
placement against least-loaded, microseconds per call.
"""

import argparse
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import django
from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = os.environ.get("BENCH_PREFIX_DB", "telemachus_bench_prefix")
WORKERS, WORKER_CONCURRENCY = 2, 16

os.environ.update(DATABASE_URL=pg_url(PG_BENCH_DB), DJANGO_SETTINGS_MODULE="telemachus.settings", LOG_LEVEL="WARNING")
sys.path.insert(0, str(ROOT))
django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from executors.models import Executor  # noqa: E402
from scheduler.core.policy import policy_for  # noqa: E402
from scheduler.core.prefix import RECORD, prompt_prefix  # noqa: E402
from scheduler.core.state import ExecutorView  # noqa: E402
from scheduler.models import Job, QueuePolicy  # noqa: E402
from scheduler.services.policy import queue_policy_update  # noqa: E402
from scheduler.services.submit import job_submit  # noqa: E402
from telemachus.teams.services import team_create, team_member_set  # noqa: E402

TOPICS = ["billing", "kubernetes", "legal review", "support tickets", "sql tuning", "security", "hr", "travel"]


def system_prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"[{i}] You are the {topic} assistant. Follow the {topic} handbook to the letter. " * 30


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "manage.py", *argv], cwd=ROOT, env=os.environ)


def wait_for(predicate, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


def run(user, *, placement: str, prefixes: int, calls: int, rate: float, hot: float | None) -> dict:
    queue_policy_update(changes={"placement": placement}, by=None)
    Job.objects.all().delete()
    rng = random.Random(39)
    chosen = [
        0 if hot is not None and rng.random() < hot else rng.randrange(0 if hot is None else 1, prefixes)
        for _ in range(calls)
    ]
    ids, started = [], time.monotonic()
    for n, p in enumerate(chosen):
        while time.monotonic() < started + n / rate:
            time.sleep(0.001)
        messages = [{"role": "system", "content": system_prompt(p)}, {"role": "user", "content": f"question {n}"}]
        job = job_submit(
            user=user,
            team="bench",
            type="chat",
            requirements={"model": "m"},
            input={"messages": messages, "max_tokens": 8},
        )
        ids.append((job.pk, p))
    wait_for(lambda: Job.objects.filter(status="done").count() == calls, timeout=calls / rate + 120, what="the calls")
    ran = dict(Job.objects.values_list("pk", "executor_id"))
    by_prefix: dict[int, Counter[int]] = {}
    for pk, p in ids:
        by_prefix.setdefault(p, Counter())[ran[pk]] += 1
    home = sum(counts.most_common(1)[0][1] for counts in by_prefix.values())
    per_executor = Counter(ran.values())
    loads = [per_executor.get(e.pk, 0) for e in Executor.objects.all()]
    waits = [
        (job.started_at - job.submitted_at).total_seconds() * 1000
        for job in Job.objects.only("started_at", "submitted_at")
    ]
    return {
        "placement": placement,
        "hot": hot,
        "home": home / calls,
        "loads": loads,
        "ratio": max(loads) / max(min(loads), 1),
        "wait_p50": percentile(waits, 0.5),
        "wait_p95": percentile(waits, 0.95),
    }


def placement_cost(servers: int, rounds: int = 20_000) -> dict[str, float]:
    """Microseconds per call: hashing a prompt at submit, and `place` with each rule."""
    messages = [{"role": "system", "content": system_prompt(0)}, {"role": "user", "content": "question"}]
    started = time.perf_counter()
    for _ in range(rounds // 10):
        prefix = prompt_prefix({"messages": messages})
    hashing = (time.perf_counter() - started) / (rounds // 10) * 1e6
    costs = {"hash a 2 KB prompt": hashing}
    for rule in (QueuePolicy.Placement.LEAST_LOADED, QueuePolicy.Placement.PREFIX):
        record = QueuePolicy(placement=rule)
        policy = policy_for(record)
        views = [ExecutorView(executor=Executor(pk=i + 1, name=f"e{i}"), limit=4, in_use=i % 3) for i in range(servers)]
        jobs = [Job(prefix=[f"{p:016x}", *(prefix or [])[1:]]) for p in range(64)]
        RECORD.forget()
        started = time.perf_counter()
        for n in range(rounds):
            policy.place(jobs[n % 64], views)
        costs[f"place, {rule}"] = (time.perf_counter() - started) / rounds * 1e6
    return costs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4, help="slots per executor")
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--calls", type=int, default=240)
    parser.add_argument("--rate", type=float, default=30, help="calls submitted per second")
    parser.add_argument("--latency-ms", type=float, default=200)
    parser.add_argument("--hot", type=float, default=0.5, help="share of calls on prefix 0 in the hot runs")
    args = parser.parse_args()
    pg_database(PG_BENCH_DB, "create")
    procs: list[subprocess.Popen] = []
    try:
        call_command("migrate", verbosity=0)
        user = get_user_model().objects.create_user("bench")
        team = team_create(slug="bench", name="bench", grants=["chat:use"])
        team_member_set(team=team, username="bench", role="member")
        for i in range(args.servers):
            port = free_port()
            procs.append(start(["simllm", "--port", str(port), "--latency-ms", str(args.latency_ms), "--models", "m"]))
            url = f"http://127.0.0.1:{port}/v1/models"
            wait_for(lambda url=url: answers(url), timeout=30, what="simllm")
            Executor.objects.create(
                name=f"server-{i}",
                kind="local-model",
                endpoint=f"http://127.0.0.1:{port}/v1",
                capabilities={"models": ["m"]},
                max_concurrency=args.slots,
            )
        procs += [
            start(["scheduler_worker", "--concurrency", str(WORKER_CONCURRENCY), "--name", f"bench-{i}"])
            for i in range(WORKERS)
        ]
        time.sleep(5)  # the workers start
        shape = {"prefixes": args.prefixes, "calls": args.calls, "rate": args.rate}
        results = [
            run(user, placement=placement, hot=hot, **shape)
            for hot in (None, args.hot)
            for placement in ("least-loaded", "prefix")
        ]
        print(
            f"bench/prefix.py: {args.servers} servers x {args.slots} slots, {args.latency_ms:g} ms a call, "
            f"{args.calls} calls at {args.rate:g}/s over {args.prefixes} prefixes; {WORKERS} workers; "
            f"chance = {1 / args.servers:.0%}"
        )
        print(
            f"{'placement':<14}{'workload':<12}{'on home':>9}{'calls per executor':>22}{'max/min':>9}"
            f"{'wait p50':>10}{'wait p95':>10}"
        )
        for r in results:
            workload = "uniform" if r["hot"] is None else f"{r['hot']:.0%} hot"
            print(
                f"{r['placement']:<14}{workload:<12}{r['home']:>9.0%}{'/'.join(map(str, r['loads'])):>22}"
                f"{r['ratio']:>9.2f}{r['wait_p50']:>8.0f}ms{r['wait_p95']:>8.0f}ms"
            )
        for what, micro in placement_cost(args.servers).items():
            print(f"{what:<28}{micro:>8.1f} µs")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
        connection.close()
        pg_database(PG_BENCH_DB, "drop")


if __name__ == "__main__":
    main()
