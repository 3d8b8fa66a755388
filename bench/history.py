r"""The queue's speed over a large history, retention's speed, and the tables' size at steady state,
on PostgreSQL (issue #37's must-show). Prints tables and a JSON line.

    .venv/bin/python bench/history.py [--history 1000000] [--ops 1000] [--prompt-bytes 2000]
                                      [--gateway-calls 500] [--prune-seconds 30] [--batch 2000]
                                      [--pace 3] [--steady-seconds 0] [--steady-rate 1000]
                                      [--steady-retention 3600] [--sample-seconds 30] [--workers 2]
                                      [--producers 2] [--bulk 1] [--prune-flow-rate 0] [--prune-jobs 0]
                                      [--steady-prefill] [--fill-connections N] [--vacuum]

The full run the issue asks for, on a quiet machine (about 30 GB of disk for the history; the
fill's rate at 200,000 jobs is printed first, with what the whole fill will take). The server
must run autovacuum (`SHOW autovacuum`: on, its default; the output warns when it is off), or
no pruned row's space is ever reused and the steady state's size cannot be flat; a
`max_wal_size` of several GB keeps checkpoints out of the fill (about 100 minutes on 2 cores):

    .venv/bin/python bench/history.py --history 10000000 --ops 2000 --gateway-calls 1000 \
        --prune-seconds 120 --prune-flow-rate 1000 --prune-jobs 1000000 --bulk 100 --producers 1 --workers 4 \
        --steady-seconds 3600 --steady-rate 1000 --steady-retention 3600 --steady-prefill --sample-seconds 60

and the steady state scaled (60 s of retention over 10 minutes; what is scaled is printed):

    .venv/bin/python bench/history.py --history 0 --steady-seconds 600 --steady-rate 1000 \
        --steady-retention 60 --sample-seconds 10 --workers 4

A small run that proves the script works (about 5 minutes here):

    .venv/bin/python bench/history.py --history 200000 --ops 300 --gateway-calls 200 \
        --prune-seconds 10 --prune-flow-rate 50 --steady-seconds 120 --steady-rate 50 --steady-retention 30 \
        --sample-seconds 5

In a scratch database `telemachus_bench_history` (created and dropped), with one team, one user
and a zero-latency sim executor:
  1. empty: `job_submit` one at a time (--ops jobs: p50/p99 ms and jobs/s), then each claimed and
     finished one at a time in-process (`job_claim` limit 1, `job_finish`: claim p50/p99 ms,
     finish p50 ms, jobs/s); then the gateway's added latency (bench/gateway.py's stack: a simllm
     model server at 0 ms, the API process, one worker): --gateway-calls one-by-one
     `POST /v1/chat/completions`, in alternating blocks straight to simllm and through the API
     process; the added time at p50 is the difference of the p50s, at p99 the gateway's p99 less
     the direct p50 (a direct call's own p99 is this machine's noise, one call in a hundred);
  2. the history, written by the server itself (INSERT ... SELECT generate_series, the jobs and
     their events in one statement per chunk of 50,000, each committed, --fill-connections
     chunks at once, one per core by default): --history jobs that
     ended two days ago, each with a --prompt-bytes prompt of random hex text (no two alike, as
     incompressible as a real one: a row number before one of 4,096 random texts), an answer, and
     its queued/started/finished events; the rate at 200,000 jobs is printed; then ANALYZE and a
     CHECKPOINT (--vacuum: VACUUM ANALYZE, as autovacuum would later);
  3. the same submit, claim/finish and gateway measures over it, and their ratios to 1;
  4. retention of one day, so the whole history is due: `manage.py telemachus_prune --pace P`
     (the workers' pacing, TELEMACHUS_PRUNE_PACE) runs in a process of its own for
     --prune-seconds while the claim/finish loop runs again; jobs pruned per second (JobTally's
     sum, no count over the table) and the claim's p99 beside pruning against it alone. With
     --prune-flow-rate R, both halves run while R jobs/s flow through --workers worker processes
     (as in 5, without their own pruning), and the claims are a probe's beside them: submit one
     job, claim one, finish it, for --prune-seconds each (with --prune-jobs N, the half beside
     pruning lasts until N jobs are pruned);
  5. with --steady-seconds: the job tables emptied (TRUNCATE); with --steady-prefill, the
     retention's worth of finished jobs written as in 2, the newest ended now and one every
     1/rate s before it (so the oldest fall due as the flow starts), then VACUUM ANALYZE, as an
     hour of the flow and autovacuum would have left the tables; then jobs flow for that long at
     --steady-rate a second (submitted in-process on a fixed schedule in bulks of up to --bulk,
     each with a --prompt-bytes prompt, run by --workers `scheduler_worker` processes on the
     sim executor) with --steady-retention seconds of retention, pruned by the workers
     themselves (TELEMACHUS_PRUNE_INTERVAL_SECONDS scaled with the retention, at least 1 s);
     pg_total_relation_size of the job and event tables every --sample-seconds, with the job
     table's live and dead rows (pg_stat_user_tables), autovacuum's visits so far and the jobs
     queued (a flow the workers do not keep up with): the series, and its slope over the second
     half (MiB/min, and as a share of the mean size over the whole second half). A retention
     shorter than an hour is a scaled run, and the output says what was scaled (autovacuum's own
     timing is not).
The database's size (jobs, events, their indexes and TOAST) is printed after each stage. --history 0
skips 2 to 4."""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
DB = "telemachus_bench_history"
ENV = {
    "DJANGO_SETTINGS_MODULE": "telemachus.settings",
    "LOG_LEVEL": "WARNING",
    "DEBUG": "0",
    "SECRET_KEY": "bench-only-" + "x" * 50,
    "ALLOWED_HOSTS": "127.0.0.1",
    "TELEMACHUS_RETENTION_HOURS": "24",
}
# The gateway's stack (bench/gateway.py): its worker must not prune the history it is measured
# over, and one token sends every call (the per-user rate of /v1/ calls would measure itself).
STACK_ENV = {
    "TELEMACHUS_RETENTION_HOURS": "1000000",
    "TELEMACHUS_OPENAI_RATE": "",
    "SECURE_SSL_REDIRECT": "0",
    "REDIS_URL": "",
}
FILL_CHUNK = 50_000
FILL_RATE_AT = 200_000
POOL = 4096  # random prompt texts; a row number before one makes each prompt its own
GATEWAY_BLOCKS = 4  # alternations of direct and gateway calls
BULK_WAIT = 0.1  # the longest a due job waits for its bulk to fill, in seconds
PRUNE_JOBS_MOST_SECONDS = 1800  # --prune-jobs' pruning ends by then, done or not

POOL_SQL = """
CREATE UNLOGGED TABLE bench_pool AS
SELECT p, (SELECT string_agg(md5(random()::text || p || g), '') FROM generate_series(1, %(chunks)s) g) AS text
FROM generate_series(0, %(pool)s - 1) p
"""
# One chunk of the history: the jobs, and their queued/started/finished events from what the
# insert returns, in one statement.
HISTORY_SQL = """
WITH jobs AS (
INSERT INTO scheduler_job (type, user_id, team_id, priority, status, requirements, model, cost_estimate,
    est_prompt_tokens, est_completion_tokens, cost, submitted_at, ready_at, queued_at, started_at,
    finished_at, tokens_used, error, input, result, attempts, meta, rounds, conversation, worker,
    affinity_key, budget_wait, executor_id)
SELECT 'chat', %(user)s, %(team)s, 0, 'done', '{"model": "m"}', 'm', 600, 500, 100, 0,
    t, t, t, t + interval '20 ms', t + interval '900 ms', 600, '',
    jsonb_build_object('messages', jsonb_build_array(jsonb_build_object('role', 'user', 'content',
        i || ' ' || pool.text))),
    '{"choices": [{"message": {"role": "assistant", "content": "an answer of a few words"}}]}',
    1, '{}', 0, '[]', 'w1', '', true, %(executor)s
FROM generate_series(%(low)s::int8, %(high)s::int8) i
    JOIN bench_pool pool ON pool.p = i %% %(pool)s
    CROSS JOIN LATERAL (SELECT now() - %(ago)s::float8 * interval '1 second'
        - i * %(step)s::float8 * interval '1 microsecond' AS t) s
RETURNING id, finished_at, executor_id
)
INSERT INTO scheduler_jobevent (job_id, executor_id, event, at, meta)
SELECT j.id, CASE WHEN e.kind = 'queued' THEN NULL ELSE j.executor_id END, e.kind, j.finished_at, e.meta::jsonb
FROM jobs j CROSS JOIN (VALUES ('queued', '{}'), ('started', '{"worker": "w1"}'),
    ('finished', '{"tokens": 600}')) AS e (kind, meta)
"""
# Rows the job table holds, live and dead (deleted, their space not yet free for reuse), and how
# often autovacuum has visited the two tables: their size stays flat only once it keeps up.
VACUUM_SQL = """
SELECT sum(n_live_tup) FILTER (WHERE relname = 'scheduler_job'),
    sum(n_dead_tup) FILTER (WHERE relname = 'scheduler_job'), sum(autovacuum_count)
FROM pg_stat_user_tables WHERE relname IN ('scheduler_job', 'scheduler_jobevent')
"""
SIZE_SQL = """
SELECT relname, pg_total_relation_size(oid) FROM pg_class
WHERE relname IN ('scheduler_job', 'scheduler_jobevent') ORDER BY relname
"""


def child(args: argparse.Namespace) -> dict:
    os.environ.update(DATABASE_URL=pg_url(DB), **ENV)
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    ids = seed()
    results: dict = {"history": args.history, "pace": args.pace, "batch": args.batch}
    measure(args.ops, ids)  # warm-up: connections, caches, compiled statements
    results["empty"] = measure(args.ops, ids)
    if args.gateway_calls:
        results["empty"].update(gateway_latency(args.gateway_calls))
    results["size_empty"] = sizes(connection)
    if args.history:
        began = time.perf_counter()
        # Ended two days ago, a millisecond apart: all of it due under a day's retention.
        results["fill"] = fill(connection, ids, args, n=args.history, ago=2 * 86400, step_us=1000, vacuum=args.vacuum)
        results["fill_seconds"] = round(time.perf_counter() - began, 1)
        results["size_full"] = sizes(connection)
        results["full"] = measure(args.ops, ids)
        if args.gateway_calls:
            results["full"].update(gateway_latency(args.gateway_calls))
        results["pruning"] = prune_while_flowing(args, ids)
        results["size_after"] = sizes(connection)
    if args.steady_seconds:
        results["steady"] = steady_state(args, ids)
    return results


def seed() -> dict:
    from django.contrib.auth import get_user_model

    from executors.models import Executor
    from telemachus.teams.services import team_create, team_member_set

    user = get_user_model().objects.create_user(username="bench", password="x")
    team = team_create(slug="bench", name="Bench", grants=("chat:use",))
    team_member_set(team=team, username="bench", role="member")
    from scheduler.models import QueuePolicy

    QueuePolicy.objects.update_or_create(pk=QueuePolicy.SINGLETON_ID, defaults={"max_queue_depth": {"default": 10**6}})
    executor = Executor.objects.create(
        name="sim", kind="sim", capabilities={"models": ["m"]}, max_concurrency=10_000, meta={"latency_ms": 0}
    )
    return {"user": user.pk, "team": team.pk, "executor": executor.pk}


def measure(ops: int, ids: dict) -> dict:
    """One-by-one submit, then one-by-one claim and finish, in-process."""
    from django.contrib.auth import get_user_model

    from scheduler.services.submit import job_submit

    user = get_user_model().objects.get(pk=ids["user"])
    submit = []
    began = time.perf_counter()
    for i in range(ops):
        t = time.perf_counter()
        job_submit(
            user=user,
            team="bench",
            type="chat",
            requirements={"model": "m", "est_tokens": 600},
            input={"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 16},
        )
        submit.append(time.perf_counter() - t)
    submit_s = time.perf_counter() - began
    (claim, finish), processing_s = claim_finish_loop(ops)
    return {
        "submit_p50_ms": ms(percentile(submit, 0.5)),
        "submit_p99_ms": ms(percentile(submit, 0.99)),
        "submit_per_s": round(ops / submit_s),
        "claim_p50_ms": ms(percentile(claim, 0.5)),
        "claim_p99_ms": ms(percentile(claim, 0.99)),
        "finish_p50_ms": ms(percentile(finish, 0.5)),
        "processed_per_s": round(ops / processing_s),
    }


def claim_finish_loop(ops: int, *, stop_after: float | None = None) -> tuple[tuple[list[float], list[float]], float]:
    """Claim and finish queued jobs one at a time until `ops` are done (or `stop_after` seconds)."""
    from scheduler.services.claim import job_claim
    from scheduler.services.finish import job_finish

    claim, finish = [], []
    began = time.perf_counter()
    for _ in range(ops):
        t = time.perf_counter()
        claims = job_claim(worker="bench", limit=1).claims
        claim.append(time.perf_counter() - t)
        if not claims:
            break
        (taken,) = claims
        t = time.perf_counter()
        job_finish(job_id=taken.job.pk, lease=taken.lease, result={"text": "ok"}, tokens_used=10)
        finish.append(time.perf_counter() - t)
        if stop_after is not None and time.perf_counter() - began > stop_after:
            break
    return (claim, finish), time.perf_counter() - began


def fill(connection, ids: dict, args: argparse.Namespace, *, n: int, ago: float, step_us: float, vacuum: bool) -> dict:
    """Write `n` finished jobs server-side, the newest ended `ago` seconds ago and each `step_us`
    before the next, in chunks of FILL_CHUNK jobs, each one committed statement, on
    --fill-connections connections at once; print the rate once FILL_RATE_AT jobs are in, and what
    the whole fill will take at it."""
    import psycopg

    found: dict = {}
    with connection.cursor() as cursor:
        cursor.execute(POOL_SQL, {"chunks": max(args.prompt_bytes // 32, 1), "pool": POOL})
    chunks = iter(range(0, n, FILL_CHUNK))
    lock = threading.Lock()
    written = 0
    began = time.perf_counter()

    def write() -> None:
        nonlocal written
        url = pg_url(DB).replace("postgres://", "postgresql://")
        with psycopg.connect(url, autocommit=True) as conn:
            while True:
                with lock:
                    low = next(chunks, None)
                if low is None:
                    return
                high = min(low + FILL_CHUNK, n) - 1
                conn.execute(HISTORY_SQL, {**ids, "low": low, "high": high, "pool": POOL, "ago": ago, "step": step_us})
                with lock:
                    written += high - low + 1
                    if "rate_at" not in found and (written >= FILL_RATE_AT or written == n):
                        elapsed = time.perf_counter() - began
                        found.update(rate_at=written, jobs_per_s=round(written / elapsed))
                        print(
                            f"fill: {written:,} jobs (and {3 * written:,} events) in {elapsed:.1f} s, "
                            f"{written / elapsed:,.0f} jobs/s on {args.fill_connections} connections: "
                            f"{n:,} will take about {n / (written / elapsed) / 60:.1f} min",
                            file=sys.stderr,
                            flush=True,
                        )

    writers = [threading.Thread(target=write) for _ in range(args.fill_connections)]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    if written != n:
        raise SystemExit(f"the fill wrote {written:,} of {n:,} jobs")
    found["insert_seconds"] = round(time.perf_counter() - began, 1)
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE bench_pool")
        began = time.perf_counter()
        for table in ("scheduler_job", "scheduler_jobevent"):
            cursor.execute(f"{'VACUUM ANALYZE' if vacuum else 'ANALYZE'} {table}")
        # The fill's gigabytes written out now, not by a checkpoint in the middle of the measures.
        cursor.execute("CHECKPOINT")
        found["analyze_checkpoint_seconds"] = round(time.perf_counter() - began, 1)
    return found


def gateway_latency(calls: int) -> dict:
    """What the gateway adds to one /v1/chat/completions call, one call at a time: bench/gateway.py's
    stack (a simllm server at 0 ms, the API process, a worker) against this database, calls in
    alternating blocks straight to simllm and through the API process, after a warm-up of each."""
    import gateway

    from executors.models import Executor

    stack = gateway.Stack({**os.environ, **STACK_ENV}, [0])
    try:
        token = gateway.seed(stack.models)
        body = {**gateway.BODY, "model": gateway.model("m", 0)}
        ways = {
            "direct": (f"{stack.models[body['model']]}/v1/chat/completions", {}),
            "gateway": (f"{stack.api}/v1/chat/completions", {"Authorization": f"Bearer {token}"}),
        }
        gateway.wait_idle([proc.pid for proc in stack.procs])

        def calls_of(way: str, total: int) -> list[float]:
            url, headers = ways[way]
            done, _ = asyncio.run(gateway.load(url, body, concurrency=1, total=total, headers=headers))
            return [latency for _, _, latency, _, _ in done]

        for way in ways:
            calls_of(way, 50)
        latency: dict[str, list[float]] = {way: [] for way in ways}
        for block in range(GATEWAY_BLOCKS):
            for way in list(ways)[:: 1 if block % 2 == 0 else -1]:
                latency[way] += calls_of(way, max(calls // GATEWAY_BLOCKS, 1))
    finally:
        stack.stop()
        # Its executors, gone with it, are not left for later workers to probe.
        Executor.objects.filter(name__in=list(stack.models)).delete()
    direct, through = latency["direct"], latency["gateway"]
    return {
        "direct_p50_ms": round(percentile(direct, 0.5), 2),
        "gateway_p50_ms": round(percentile(through, 0.5), 2),
        "gateway_p99_ms": round(percentile(through, 0.99), 2),
        "gateway_added_p50_ms": round(percentile(through, 0.5) - percentile(direct, 0.5), 2),
        "gateway_added_p99_ms": round(percentile(through, 0.99) - percentile(direct, 0.5), 2),
    }


def prune_while_flowing(args: argparse.Namespace, ids: dict) -> dict:
    """Claims and finishes without pruning, then the same beside `telemachus_prune`. With
    --prune-flow-rate, both while jobs flow at that rate through worker processes (which do not
    prune: the command does), the claims timed by a probe that submits, claims and finishes one
    job at a time beside them, for --prune-seconds each; else the claim/finish loop alone."""
    from django.contrib.auth import get_user_model
    from django.db.models import Sum

    from scheduler.models import Job, JobTally
    from scheduler.services.submit import job_submit

    user = get_user_model().objects.get(pk=ids["user"])

    def queue(n: int) -> None:
        for i in range(n):
            job_submit(
                user=user,
                team="bench",
                type="chat",
                requirements={"model": "m", "est_tokens": 600},
                input={"messages": [{"role": "user", "content": f"flow {i}"}], "max_tokens": 16},
            )

    def pruned() -> int:
        return JobTally.objects.aggregate(n=Sum("jobs"))["n"] or 0

    flow = None
    if args.prune_flow_rate:
        flow = Flow(args, ids, rate=args.prune_flow_rate, retention_hours=1e6, prune_interval=30, name="flow")
        flow.start()
        time.sleep(5)  # the workers' start-up
        alone = probe_claims(args.prune_seconds, queue)
    else:
        queue(args.ops)
        (alone, _), _ = claim_finish_loop(args.ops)
        queue(args.ops * 20)
    env = {**os.environ, "TELEMACHUS_PRUNE_BATCH": str(args.batch)}
    pruner = subprocess.Popen(
        [sys.executable, "manage.py", "telemachus_prune", "--pace", str(args.pace)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.perf_counter() + 120
        while not pruned() and time.perf_counter() < deadline:  # the command's start-up
            time.sleep(0.05)
        began, first = time.perf_counter(), pruned()
        if flow is not None and args.prune_jobs:
            beside = probe_claims(PRUNE_JOBS_MOST_SECONDS, queue, done=lambda: pruned() - first >= args.prune_jobs)
            loop_s = time.perf_counter() - began
        elif flow is not None:
            beside = probe_claims(args.prune_seconds, queue)
            loop_s = time.perf_counter() - began
        else:
            (beside, _), loop_s = claim_finish_loop(args.ops * 20, stop_after=args.prune_seconds)
        deleted = pruned() - first
        elapsed = time.perf_counter() - began
    finally:
        pruner.terminate()
        pruner.wait(timeout=60)
        if flow is not None:
            flow.stop()
    found = {
        "claim_p50_ms_alone": ms(percentile(alone, 0.5)),
        "claim_p99_ms_alone": ms(percentile(alone, 0.99)),
        "claim_p50_ms_pruning": ms(percentile(beside, 0.5)),
        "claim_p99_ms_pruning": ms(percentile(beside, 0.99)),
        "claims_beside_pruning": len(beside),
        "claims_per_s_beside_pruning": round(len(beside) / loop_s),
        "jobs_pruned": deleted,
        "pruned_per_s": round(deleted / elapsed),
    }
    if flow is not None:
        found.update(
            flow_rate_asked=args.prune_flow_rate,
            flow_rate_submitted=flow.rate_submitted,
            queued_after_flow=Job.objects.filter(status=Job.Status.QUEUED).count(),
        )
    return found


def probe_claims(seconds: float, queue: Callable[[int], None], done: Callable[[], bool] = lambda: False) -> list[float]:
    """For `seconds` (or until `done()`, asked once a second): submit a job, claim one (it or
    another: workers claim beside it) and finish it, one at a time; the claims that took a job,
    timed."""
    from scheduler.services.claim import job_claim
    from scheduler.services.finish import job_finish

    timed = []
    until = time.perf_counter() + seconds
    asked = time.perf_counter()
    while time.perf_counter() < until:
        if time.perf_counter() - asked >= 1:
            if done():
                break
            asked = time.perf_counter()
        queue(1)
        t = time.perf_counter()
        claims = job_claim(worker="bench", limit=1).claims
        took = time.perf_counter() - t
        for taken in claims:
            timed.append(took)
            job_finish(job_id=taken.job.pk, lease=taken.lease, result={"text": "ok"}, tokens_used=10)
    return timed


class Flow:
    """Jobs flowing at `rate` a second: submitted in-process on a fixed schedule by --producers
    threads (in bulks of up to --bulk: one-by-one submits cost about a core at 1,000 a second),
    each with a --prompt-bytes prompt, run by --workers `scheduler_worker` processes on the sim
    executor, which prune with `retention_hours` every `prune_interval` seconds."""

    def __init__(
        self,
        args: argparse.Namespace,
        ids: dict,
        *,
        rate: float,
        retention_hours: float,
        prune_interval: float,
        name: str,
    ) -> None:
        self.args, self.ids, self.rate, self.name = args, ids, rate, name
        self.env = {
            **os.environ,
            "TELEMACHUS_RETENTION_HOURS": repr(retention_hours),
            "TELEMACHUS_PRUNE_INTERVAL_SECONDS": repr(prune_interval),
        }
        # Prompts of --prompt-bytes like the history's: a job's number before one of POOL random texts.
        self.texts = [os.urandom(args.prompt_bytes // 2).hex() for _ in range(POOL)]
        self.counts = [0] * args.producers
        self.halt = threading.Event()
        self.workers: list[subprocess.Popen] = []
        self.producers: list[threading.Thread] = []
        self.rate_submitted = 0.0
        self.failure: BaseException | None = None

    @property
    def submitted(self) -> int:
        return sum(self.counts)

    def start(self) -> None:
        self.workers = [
            subprocess.Popen(
                [sys.executable, "manage.py", "scheduler_worker", "--concurrency", "64", "--name", f"{self.name}{i}"],
                cwd=ROOT,
                env=self.env,
                stdout=subprocess.DEVNULL,
            )
            for i in range(self.args.workers)
        ]
        self.producers = [threading.Thread(target=self._produce, args=(i,)) for i in range(self.args.producers)]
        self.began = time.perf_counter()
        for thread in self.producers:
            thread.start()

    def stop(self) -> None:
        self.halt.set()
        for thread in self.producers:
            thread.join()
        self.rate_submitted = round(self.submitted / (time.perf_counter() - self.began), 1)
        if self.failure is not None:  # a flow that stopped would measure as flat: no figures at all
            raise RuntimeError(f"a producer stopped: {self.failure!r}") from self.failure
        for worker in self.workers:
            worker.send_signal(signal.SIGTERM)
        for worker in self.workers:
            worker.wait(timeout=120)

    def _produce(self, index: int) -> None:
        """Submit on a fixed schedule, this producer's share of the rate, what is due at once in
        bulks of up to --bulk; behind it, catch up."""
        from django.contrib.auth import get_user_model
        from django.db import connection

        from scheduler.services.submit import JobSpec, job_submit, jobs_submit

        user = get_user_model().objects.get(pk=self.ids["user"])
        rate = self.rate / len(self.counts)
        try:
            while not self.halt.is_set():
                elapsed = time.perf_counter() - self.began
                due = int(rate * elapsed)
                waited = elapsed - (self.counts[index] + 1) / rate  # by the first job due (< 0: none is)
                if due - self.counts[index] < self.args.bulk and waited < BULK_WAIT:
                    until_bulk = (self.counts[index] + self.args.bulk) / rate - elapsed
                    time.sleep(max(min(until_bulk, BULK_WAIT - waited, 0.05), 0.0))
                    continue
                specs = [
                    JobSpec(
                        team="bench",
                        type="chat",
                        requirements={"model": "m", "est_tokens": 600},
                        input={
                            "messages": [{"role": "user", "content": f"{index}.{number} {self.texts[number % POOL]}"}]
                        },
                    )
                    for number in range(self.counts[index], min(due, self.counts[index] + self.args.bulk))
                ]
                if len(specs) == 1:
                    (spec,) = specs
                    job_submit(
                        user=user, team=spec.team, type=spec.type, requirements=spec.requirements, input=spec.input
                    )
                else:
                    jobs_submit(user=user, jobs=specs)
                self.counts[index] += len(specs)
        except BaseException as exc:
            self.failure = exc
            self.halt.set()
            raise
        finally:
            connection.close()


def steady_state(args: argparse.Namespace, ids: dict) -> dict:
    """Jobs flowing at --steady-rate for --steady-seconds, run by --workers worker processes that
    prune with --steady-retention, from empty job tables; the tables' size every --sample-seconds."""
    from django.db import connection

    from scheduler.models import Job

    retention = args.steady_retention
    interval = max(30 * retention / 3600, 1.0)
    scaled = (
        f"scaled: retention {retention:g} s instead of 3,600 s (x{3600 / retention:.3g} faster), the workers' "
        f"pruning every {interval:g} s instead of 30 s; the rate ({args.steady_rate:g}/s), the batch size and "
        "autovacuum's timing are not scaled"
        if retention < 3600
        else ""
    )
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE scheduler_job, scheduler_jobevent, scheduler_jobtally, scheduler_slot CASCADE")
        # Without autovacuum the space of pruned rows is never reused: the size cannot be flat.
        cursor.execute("SHOW autovacuum")
        (autovacuum,) = cursor.fetchone()
        cursor.execute("SHOW autovacuum_naptime")
        (naptime,) = cursor.fetchone()
    prefill = None
    if args.steady_prefill:
        # The window as an hour of this flow would leave it: the retention's worth of jobs, the
        # newest ended now, one every 1/rate s, so the oldest fall due as the flow starts; vacuumed,
        # as autovacuum would have by then.
        jobs = round(args.steady_rate * retention)
        prefill = fill(connection, ids, args, n=jobs, ago=0, step_us=1e6 / args.steady_rate, vacuum=True)
        prefill["jobs"] = jobs
    flow = Flow(
        args, ids, rate=args.steady_rate, retention_hours=retention / 3600, prune_interval=interval, name="steady"
    )
    series: list[tuple[float, float, float, int, int, int, int]] = []
    began = time.perf_counter()
    flow.start()
    try:
        while (elapsed := time.perf_counter() - began) < args.steady_seconds:
            size = sizes_bytes(connection)
            with connection.cursor() as cursor:
                cursor.execute(VACUUM_SQL)
                live, dead, vacuums = cursor.fetchone()
            queued = Job.objects.filter(status=Job.Status.QUEUED).count()
            series.append(
                (
                    round(elapsed, 1),
                    size["scheduler_job"] / 2**20,
                    size["scheduler_jobevent"] / 2**20,
                    int(live or 0),
                    int(dead or 0),
                    int(vacuums or 0),
                    queued,
                )
            )
            print(
                f"steady {elapsed:6.0f} s: jobs {series[-1][1]:8.1f} MiB, events {series[-1][2]:8.1f} MiB, "
                f"{flow.submitted:,} submitted, {queued:,} queued, jobs live {live} dead {dead}, autovacuums {vacuums}",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(max(args.sample_seconds - (time.perf_counter() - began - elapsed), 0))
    finally:
        flow.stop()
    second_half = [(t, jobs + events) for t, jobs, events, *_ in series if t >= args.steady_seconds / 2]
    slope = _slope(second_half) * 60
    mean = sum(total for _, total in second_half) / len(second_half) if second_half else 0.0
    half_minutes = args.steady_seconds / 2 / 60
    return {
        "seconds": args.steady_seconds,
        "rate_asked": args.steady_rate,
        "rate_submitted": flow.rate_submitted,
        "retention_seconds": retention,
        "prune_interval_seconds": interval,
        "scaled": scaled,
        "autovacuum": f"{autovacuum} (naptime {naptime})",
        "prefill": prefill,
        "queued_at_end": Job.objects.filter(status=Job.Status.QUEUED).count(),
        "series": [(t, round(jobs, 1), round(events, 1), *rows) for t, jobs, events, *rows in series],
        "second_half_slope_mib_per_min": round(slope, 3),
        "second_half_growth": round(slope * half_minutes / mean, 4) if mean else None,
    }


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y): y per second."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / spread if spread else 0.0


def sizes_bytes(connection) -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(SIZE_SQL)
        return dict(cursor.fetchall())


def sizes(connection) -> dict:
    return {name: f"{size / 2**20:.0f} MiB" for name, size in sizes_bytes(connection).items()}


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=1_000_000, help="finished jobs to write (0: no history)")
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--prompt-bytes", type=int, default=2000)
    parser.add_argument(
        "--fill-connections", type=int, default=os.cpu_count() or 2, help="connections writing the history at once"
    )
    parser.add_argument("--vacuum", action="store_true", help="VACUUM ANALYZE after the fill, not only ANALYZE")
    parser.add_argument("--gateway-calls", type=int, default=500, help="one-by-one /v1/ calls each way (0: none)")
    parser.add_argument("--prune-seconds", type=float, default=30)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--pace", type=float, default=3.0, help="the pruner's pace (TELEMACHUS_PRUNE_PACE)")
    parser.add_argument(
        "--prune-flow-rate", type=float, default=0, help="jobs/s flowing through workers while pruning (0: none)"
    )
    parser.add_argument("--steady-seconds", type=float, default=0, help="how long jobs flow (0: no steady state)")
    parser.add_argument("--steady-rate", type=float, default=1000, help="jobs submitted a second")
    parser.add_argument("--steady-retention", type=float, default=3600, help="seconds of retention")
    parser.add_argument("--sample-seconds", type=float, default=30)
    parser.add_argument("--workers", type=int, default=2, help="worker processes in the steady state")
    parser.add_argument("--producers", type=int, default=2, help="submitting threads in the steady state")
    parser.add_argument("--bulk", type=int, default=1, help="the most jobs a producer submits at once (jobs_submit)")
    parser.add_argument(
        "--prune-jobs", type=int, default=0, help="with --prune-flow-rate: prune this many (0: for --prune-seconds)"
    )
    parser.add_argument(
        "--steady-prefill",
        action="store_true",
        help="write the retention's worth of finished jobs first, as if the flow had run that long",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.prune_jobs and not args.prune_flow_rate:
        parser.error("--prune-jobs needs --prune-flow-rate: without a flow the pruning runs for --prune-seconds")
    if args.child:
        print(json.dumps(child(args)))
        return
    pg_database(DB, "create")
    try:
        # Progress (the fill's rate, the steady state's samples) goes to stderr as it comes.
        out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
    finally:
        pg_database(DB, "drop")
    if out.returncode:
        sys.exit(out.returncode)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    report(results)
    print(json.dumps(results))


def report(r: dict) -> None:
    print("| measure | empty | with history | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for key, empty in r["empty"].items():
        full = r.get("full", {}).get(key, "")
        ratio = f"{full / empty:.2f}" if full != "" and empty else ""
        print(f"| {key} | {empty} | {full} | {ratio} |")
    print(f"sizes: empty {r['size_empty']}")
    if r["history"]:
        f = r["fill"]
        print(
            f"history: {r['history']:,} finished jobs written in {r['fill_seconds']} s ({f['jobs_per_s']:,} jobs/s at "
            f"{f['rate_at']:,}; ANALYZE and CHECKPOINT {f['analyze_checkpoint_seconds']} s)"
        )
        print(f"sizes: full {r['size_full']}, after pruning {r['size_after']}")
        p = r["pruning"]
        print(
            f"claim p50/p99 ms alone {p['claim_p50_ms_alone']}/{p['claim_p99_ms_alone']}, beside pruning "
            f"{p['claim_p50_ms_pruning']}/{p['claim_p99_ms_pruning']} (p99 ratio "
            f"{p['claim_p99_ms_pruning'] / p['claim_p99_ms_alone']:.2f}; {p['claims_beside_pruning']} claims, "
            f"{p['claims_per_s_beside_pruning']}/s); pruned {p['jobs_pruned']:,} jobs at {p['pruned_per_s']:,}/s"
        )
        if "flow_rate_asked" in p:
            print(
                f"while jobs flowed: {p['flow_rate_submitted']}/s submitted (asked {p['flow_rate_asked']:g}/s), "
                f"{p['queued_after_flow']:,} queued after it"
            )
    if "steady" in r:
        st = r["steady"]
        print(
            f"steady state: {st['rate_submitted']}/s submitted (asked {st['rate_asked']:g}/s) for {st['seconds']:g} s, "
            f"retention {st['retention_seconds']:g} s, {st['queued_at_end']} queued at the end"
        )
        if st["scaled"]:
            print(st["scaled"])
        if st["prefill"]:
            pf = st["prefill"]
            print(
                f"prefilled: {pf['jobs']:,} finished jobs over the retention's window, {pf['jobs_per_s']:,} jobs/s, "
                f"then VACUUM ANALYZE and CHECKPOINT {pf['analyze_checkpoint_seconds']} s"
            )
        print(f"the server's autovacuum: {st['autovacuum']}")
        if st["autovacuum"].startswith("off"):
            print("WARNING: autovacuum is off on this server: pruned rows' space is never reused, so the size grows")
        print("| t s | jobs MiB | events MiB | jobs live | jobs dead | autovacuums (both tables) | queued |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for t, jobs, events, live, dead, vacuums, queued in st["series"]:
            print(f"| {t:g} | {jobs} | {events} | {live:,} | {dead:,} | {vacuums} | {queued:,} |")
        print(
            f"second half: slope {st['second_half_slope_mib_per_min']} MiB/min, growth over it "
            f"{st['second_half_growth']} of its mean size (flat: near 0)"
        )


if __name__ == "__main__":
    main()
