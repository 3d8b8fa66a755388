"""Flows on PostgreSQL with real worker processes and the `sim` executor. Prints tables.

    .venv/bin/python bench/flows.py [--parts 1,2,3] [--latency-ms 50] [--flow-rounds 50] [--chats 20]
        [--flows 100] [--rounds 10] [--slots 8] [--affinity-flows 16] [--affinity-chats 100]

In a scratch database `telemachus_bench_flows` on 127.0.0.1 (BENCH_FLOWS_DB names another;
created and dropped), one team, one `sim` executor (each model call takes --latency-ms), two
`scheduler_worker --concurrency 16` processes, default policy settings unless a part says
otherwise. Times are the database's stamps.

  1. One slot shared: the executor has one slot. A --flow-rounds round flow (the sim model calls
     `echo` until the last round) starts; once its first round has started, --chats chats of the
     same team and priority are queued in one transaction. Reported: the chats' wait (started_at
     - submitted_at), p50 and p95, against the flow's duration (submit to finish), and how many
     chats ended before the flow. Once per QueuePolicy.flow_rounds: `requeue` (the default: a
     round queues behind work that became ready while the last one ran) and `continue` (a started
     flow keeps its place, ahead of newer work of its priority and team).
  2. Rounds/s: --flows flows of --rounds rounds on --slots slots, against the same number of model
     calls as plain chats (flows x rounds), all queued at once. Reported: model calls per second,
     from the first start to the last finish, and against the ideal (slots / latency): what the
     round trip through the queue between rounds (finish, tools, requeue, claim) costs.
  3. Round affinity: the --slots slots split evenly over 2, then 4 `sim` executors. --affinity-flows
     flows of --rounds rounds are queued; once all have started, --affinity-chats chats are queued
     in one transaction. Once with QueuePolicy.affinity = off, once with prefer. Reported: the
     affinity hit rate (of the rounds after a flow's first, the share that ran on the executor
     of the flow's previous round), the chats' wait (started_at - submitted_at), p50 and p95,
     and model calls per second (first start to last finish).
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import django
from benchlib import percentile, pg_database, pg_url

ROOT = Path(__file__).resolve().parent.parent
PG_BENCH_DB = os.environ.get("BENCH_FLOWS_DB", "telemachus_bench_flows")
WORKERS, WORKER_CONCURRENCY = 2, 16

os.environ.update(DATABASE_URL=pg_url(PG_BENCH_DB), DJANGO_SETTINGS_MODULE="telemachus.settings", LOG_LEVEL="WARNING")
sys.path.insert(0, str(ROOT))
django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.models import Max, Min  # noqa: E402
from django.utils import timezone  # noqa: E402

from executors.models import Executor  # noqa: E402
from scheduler.models import Job, JobEvent, Slot, TeamShare  # noqa: E402
from scheduler.services.policy import queue_policy_update  # noqa: E402
from scheduler.services.submit import job_submit  # noqa: E402
from telemachus.control import notify  # noqa: E402
from telemachus.teams.services import team_create, team_member_set  # noqa: E402

MODEL = "sim"


def seed(latency_ms: float) -> tuple:
    user = get_user_model().objects.create_user("bench")
    team = team_create(slug="bench", name="bench", grants=["chat:use", "tools:invoke", "flows:run"])
    team_member_set(team=team, username="bench", role="member")
    Executor.objects.create(
        name="sim",
        kind="sim",
        capabilities={"models": [MODEL]},
        max_concurrency=1,
        meta={"latency_ms": latency_ms, "output_tokens": 8},
    )
    return user, team


def reset(*, slots: int, executors: int = 0) -> None:
    """Empty the queue; `sim` alone with `slots` slots, or (`executors` > 0) the slots split
    evenly over that many executors sim-1, sim-2, ..."""
    tables = ", ".join(model._meta.db_table for model in (Slot, JobEvent, Job, TeamShare))
    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {tables}")
    Executor.objects.update(enabled=False)
    if not executors:
        Executor.objects.filter(name="sim").update(max_concurrency=slots, enabled=True)
        return
    sim = Executor.objects.get(name="sim")
    for i in range(1, executors + 1):
        Executor.objects.update_or_create(
            name=f"sim-{i}",
            defaults={
                "kind": "sim",
                "capabilities": sim.capabilities,
                "meta": sim.meta,
                "max_concurrency": slots // executors,
                "enabled": True,
            },
        )


def flow_input(rounds: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"work [rounds:{rounds}]"}],
        "tools": ["echo"],
        "max_rounds": rounds,
        "max_tokens": 8,
    }


def chat_job(user, team) -> Job:
    return Job(
        type="chat",
        user=user,
        team=team,
        requirements={"model": MODEL},
        model=MODEL,
        input={"messages": [{"role": "user", "content": "x"}], "max_tokens": 8},
    )


def start_workers() -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "scheduler_worker",
                "--concurrency",
                str(WORKER_CONCURRENCY),
                "--name",
                f"bench-{i}",
            ],
            cwd=ROOT,
            env=os.environ,
        )
        for i in range(WORKERS)
    ]


def stop_workers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=120)


def wait_for(predicate, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def bulk_queue(jobs: list[Job]) -> list[Job]:
    """Queue jobs in one transaction (ready, and submitted, now) and wake the workers on commit."""
    now = timezone.now()
    for job in jobs:
        job.submitted_at = job.ready_at = job.queued_at = now
    with transaction.atomic():
        created = Job.objects.bulk_create(jobs, batch_size=5_000)
        notify.notify_workers(notify.QUEUED)
    return created


# --- part 1 ----------------------------------------------------------------------------------------


def shared_slot(user, team, *, mode: str, rounds: int, chats: int) -> dict:
    reset(slots=1)
    queue_policy_update(changes={"flow_rounds": mode}, by=None)
    procs = start_workers()
    try:
        flow = job_submit(
            user=user,
            team=team.slug,
            type="flow",
            requirements={"model": MODEL, "est_tokens": 10},
            input=flow_input(rounds),
        )
        wait_for(
            lambda: JobEvent.objects.filter(job=flow, event="round_started").exists(),
            timeout=60,
            what="the flow's first round",
        )
        queued = bulk_queue([chat_job(user, team) for _ in range(chats)])
        ids = [job.pk for job in queued] + [flow.pk]
        wait_for(
            lambda: Job.objects.filter(pk__in=ids, status="done").count() == len(ids),
            timeout=60 + rounds * 5,
            what="the flow and the chats",
        )
    finally:
        stop_workers(procs)
    flow.refresh_from_db()
    waits, before = [], 0
    for job in Job.objects.filter(pk__in=[job.pk for job in queued]):
        waits.append((job.started_at - job.submitted_at).total_seconds())
        before += job.finished_at < flow.finished_at
    return {
        "mode": mode,
        "p50": percentile(waits, 0.5),
        "p95": percentile(waits, 0.95),
        "flow": (flow.finished_at - flow.submitted_at).total_seconds(),
        "before": before,
        "chats": chats,
        "rounds": flow.rounds,
    }


def print_shared(rows: list[dict], *, latency_ms: float) -> None:
    print(
        f"\n## 1. One slot: a {rows[0]['rounds']}-round flow and {rows[0]['chats']} chats "
        f"(model call {latency_ms:g} ms)\n"
    )
    print("| flow_rounds | chats' wait p50 s | chats' wait p95 s | flow duration s | chats done before the flow |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['p50']:.2f} | {r['p95']:.2f} | {r['flow']:.2f} | {r['before']} of {r['chats']} |")


# --- part 2 ----------------------------------------------------------------------------------------


def flow_jobs(user, team, *, flows: int, rounds: int) -> list[Job]:
    return [
        Job(
            type="flow",
            user=user,
            team=team,
            requirements={"model": MODEL, "est_tokens": 10},
            model=MODEL,
            cost_estimate=10,
            input=flow_input(rounds),
        )
        for _ in range(flows)
    ]


def calls_per_second(user, team, *, kind: str, flows: int, rounds: int, slots: int) -> dict:
    reset(slots=slots)
    queue_policy_update(changes={"flow_rounds": "requeue"}, by=None)
    if kind == "flows":
        jobs = flow_jobs(user, team, flows=flows, rounds=rounds)
    else:
        jobs = [chat_job(user, team) for _ in range(flows * rounds)]
    procs = start_workers()
    try:
        ids = [job.pk for job in bulk_queue(jobs)]
        wait_for(
            lambda: Job.objects.filter(pk__in=ids, status__in=Job.TERMINAL).count() == len(ids),
            timeout=60 + flows * rounds,
            what=f"the {kind}",
        )
    finally:
        stop_workers(procs)
    done = Job.objects.filter(pk__in=ids, status="done")
    assert done.count() == len(ids), f"only {done.count()} of {len(ids)} {kind} done"
    first = JobEvent.objects.filter(job_id__in=ids, event="started").aggregate(t=Min("at"))["t"]
    last = done.aggregate(t=Max("finished_at"))["t"]
    calls = flows * rounds
    span = (last - first).total_seconds()
    return {"kind": kind, "jobs": len(ids), "calls": calls, "span": span, "rate": calls / span}


def print_rates(rows: list[dict], *, slots: int, latency_ms: float) -> None:
    ideal = slots / (latency_ms / 1000)
    print(f"\n## 2. Model calls per second on {slots} slots (model call {latency_ms:g} ms; ideal {ideal:.0f}/s)\n")
    print("| work | jobs | model calls | seconds | calls/s | of ideal |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['kind']} | {r['jobs']} | {r['calls']} | {r['span']:.1f} | {r['rate']:.1f} | "
            f"{r['rate'] / ideal:.0%} |"
        )
    if len(rows) == 2:
        print(f"\nflows / chats: {rows[0]['rate'] / rows[1]['rate']:.2f}x")


# --- part 3 ----------------------------------------------------------------------------------------


def hit_rate(flow_ids: list[int]) -> float:
    """Of the rounds after each flow's first, the share placed on its previous round's executor."""
    placed: dict[int, dict[int, int]] = {}
    for job_id, number, executor in JobEvent.objects.filter(job_id__in=flow_ids, event="round_started").values_list(
        "job_id", "meta__round", "executor_id"
    ):
        placed.setdefault(job_id, {})[number] = executor
    pairs = [(rounds[n - 1], rounds[n]) for rounds in placed.values() for n in rounds if n - 1 in rounds]
    return sum(before == after for before, after in pairs) / len(pairs) if pairs else 0.0


def affinity_run(user, team, *, affinity: str, executors: int, flows: int, rounds: int, chats: int, slots: int) -> dict:
    reset(slots=slots, executors=executors)
    queue_policy_update(changes={"flow_rounds": "requeue", "affinity": affinity}, by=None)
    procs = start_workers()
    try:
        flow_ids = [job.pk for job in bulk_queue(flow_jobs(user, team, flows=flows, rounds=rounds))]
        wait_for(
            lambda: Job.objects.filter(pk__in=flow_ids, started_at__isnull=False).count() == len(flow_ids),
            timeout=120,
            what="every flow started",
        )
        chat_ids = [job.pk for job in bulk_queue([chat_job(user, team) for _ in range(chats)])]
        ids = flow_ids + chat_ids
        wait_for(
            lambda: Job.objects.filter(pk__in=ids, status__in=Job.TERMINAL).count() == len(ids),
            timeout=120 + flows * rounds,
            what="the flows and chats",
        )
    finally:
        stop_workers(procs)
    assert Job.objects.filter(pk__in=ids, status="done").count() == len(ids), "not all done"
    waits = [
        (started - submitted).total_seconds()
        for started, submitted in Job.objects.filter(pk__in=chat_ids).values_list("started_at", "submitted_at")
    ]
    first = JobEvent.objects.filter(job_id__in=ids, event="started").aggregate(t=Min("at"))["t"]
    last = Job.objects.filter(pk__in=ids).aggregate(t=Max("finished_at"))["t"]
    return {
        "executors": executors,
        "affinity": affinity,
        "hits": hit_rate(flow_ids),
        "p50": percentile(waits, 0.5),
        "p95": percentile(waits, 0.95),
        "rate": (flows * rounds + chats) / (last - first).total_seconds(),
    }


def print_affinity(rows: list[dict], *, flows: int, rounds: int, chats: int, slots: int, latency_ms: float) -> None:
    print(
        f"\n## 3. Round affinity: {flows} flows of {rounds} rounds, then {chats} chats, on {slots} slots "
        f"split over the executors (model call {latency_ms:g} ms)\n"
    )
    print("| executors | affinity | hit rate | chats' wait p50 s | chats' wait p95 s | model calls/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['executors']} | {r['affinity']} | {r['hits']:.0%} | {r['p50']:.2f} | {r['p95']:.2f} | "
            f"{r['rate']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="1,2,3")
    parser.add_argument("--latency-ms", type=float, default=50, help="one model call (sim), ms")
    parser.add_argument("--flow-rounds", type=int, default=50, help="part 1: rounds of the flow")
    parser.add_argument("--chats", type=int, default=20, help="part 1: chats queued while it runs")
    parser.add_argument("--flows", type=int, default=100, help="part 2: flows")
    parser.add_argument("--rounds", type=int, default=10, help="part 2: rounds per flow")
    parser.add_argument("--slots", type=int, default=8, help="parts 2 and 3: the slots in all")
    parser.add_argument("--affinity-flows", type=int, default=16, help="part 3: flows")
    parser.add_argument("--affinity-chats", type=int, default=100, help="part 3: chats queued once they run")
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}

    pg_database(PG_BENCH_DB, "create")
    try:
        call_command("migrate", verbosity=0)
        user, team = seed(args.latency_ms)
        print(f"bench/flows.py at {timezone.now():%Y-%m-%d %H:%M} UTC; {WORKERS} workers x {WORKER_CONCURRENCY}")
        if 1 in parts:
            print_shared(
                [
                    shared_slot(user, team, mode=mode, rounds=args.flow_rounds, chats=args.chats)
                    for mode in ("requeue", "continue")
                ],
                latency_ms=args.latency_ms,
            )
        if 2 in parts:
            print_rates(
                [
                    calls_per_second(user, team, kind=kind, flows=args.flows, rounds=args.rounds, slots=args.slots)
                    for kind in ("flows", "chats")
                ],
                slots=args.slots,
                latency_ms=args.latency_ms,
            )
        if 3 in parts:
            shape = {"flows": args.affinity_flows, "rounds": args.rounds, "chats": args.affinity_chats}
            print_affinity(
                [
                    affinity_run(user, team, affinity=affinity, executors=executors, slots=args.slots, **shape)
                    for executors in (2, 4)
                    for affinity in ("off", "prefer")
                ],
                slots=args.slots,
                latency_ms=args.latency_ms,
                **shape,
            )
    finally:
        connection.close()
        pg_database(PG_BENCH_DB, "drop")


if __name__ == "__main__":
    main()
