"""One hop (scheduler/gateway/onehop.py) with real processes on PostgreSQL: API processes (as
bin/run serves the app: telemachus/serve.py) that claim and run the /v1/ calls they hold, a worker
beside them, a real model server that counts its concurrent requests. The caps hold on the wire,
the queue's order holds across teams, and an API process killed mid-call leaves a job that is
recovered like a worker's."""

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from django.db.models import Min
from django.utils import timezone

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, QueuePolicy, Slot, TeamShare
from scheduler.services.claim import job_claim
from scheduler.services.submit import job_submit
from tests.concurrency.sessions import postgres_session
from tests.concurrency.slots import SlotSampler
from tests.credentials import token_for
from tests.processes import http_json, wait_until
from tests.scheduler.gateway.conftest import may_chat

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# Quick retries and no probes: nothing here is about them.
ENV = {"TELEMACHUS_PROBE_INTERVAL_SECONDS": "3600", "TELEMACHUS_OPENAI_RATE": ""}


def call(base: str, token: str, *, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        data=json.dumps(BODY).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def member(make_user, username: str):
    """A user allowed to chat (a global grant: see may_chat)."""
    return may_chat(make_user(username))


def in_process(jobs) -> int:
    """How many of the jobs' first attempts an API process ran (its claims name it `api:...`)."""
    started = JobEvent.objects.filter(job__in=jobs, event="started")
    return sum(1 for meta in started.values_list("meta", flat=True) if str(meta.get("worker", "")).startswith("api:"))


def test_a_team_cap_of_two_holds_on_the_wire_with_twenty_calls_through_two_api_processes(
    processes, make_user, make_team
):
    # Given a model server that counts its concurrent requests, an executor with room for ten, a
    # team cap of two, two API processes and a worker...
    server = processes.simllm(latency_ms=150)
    Executor.objects.create(
        name="x", kind="local-model", endpoint=f"{server}/x/v1", capabilities={"models": ["m"]}, max_concurrency=10
    )
    alice, bob = member(make_user, "alice"), member(make_user, "bob")
    team = make_team("a", {alice: "member", bob: "member"})
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=2)
    apis = [processes.api_server(f"api{i}", **ENV) for i in range(2)]
    processes.worker("w1", concurrency=16, **ENV)
    tokens = [token_for(alice), token_for(bob)]

    # When twenty calls arrive at once, half through each API process...
    with SlotSampler() as sampler, ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda i: call(apis[i % 2], tokens[i % 2]), range(20)))

    # Then every call was answered, never more than two were at the model server, and the cap
    # really bound (this is not a test that cannot fail)...
    assert [status for status, _ in answers] == [200] * 20
    stats = http_json(f"{server}/stats")
    assert stats["prefixes"]["x"]["peak"] == 2
    assert stats["requests"] == 20
    assert sampler.peak["team"][team.pk] == 2
    # ...each job finished exactly once, and an API process ran at least one itself (how many
    # depends on which claim reaches the claim lock first: a claim whose call is not next leaves
    # it to the workers, so more than one is a race, not a guarantee).
    jobs = Job.objects.filter(team=team)
    assert sorted(jobs.values_list("status", flat=True)) == ["done"] * 20
    finished = Counter(JobEvent.objects.filter(event="finished", job__in=jobs).values_list("job_id", flat=True))
    assert len(finished) == 20 and set(finished.values()) == {1}
    assert not JobEvent.objects.filter(event="finish_refused").exists()
    ran_here = in_process(jobs)
    assert ran_here >= 1, f"{ran_here} calls ran in an API process"
    assert not Slot.objects.exists()


@pytest.mark.parametrize("one_hop", ["1", "0"])
def test_fair_share_across_two_teams_holds_through_v1_as_through_workers(processes, make_user, make_team, one_hop):
    # Given two slots, team a with a large past usage and team b with none (so b's waiting calls
    # always go first), eight clients of each team calling in a loop through two API processes,
    # and a worker...
    server = processes.simllm(latency_ms=150)
    Executor.objects.create(
        name="x", kind="local-model", endpoint=f"{server}/x/v1", capabilities={"models": ["m"]}, max_concurrency=2
    )
    alice, bob = member(make_user, "alice"), member(make_user, "bob")
    team_a = make_team("a", {alice: "member"})
    make_team("b", {bob: "member"})
    TeamShare.objects.create(team=team_a, usage=1e9, updated_at=timezone.now())
    QueuePolicy.objects.update_or_create(pk=1, defaults={"half_life_seconds": 3600})
    env = {**ENV, "TELEMACHUS_GATEWAY_ONE_HOP": one_hop}
    apis = [processes.api_server(f"api{i}", **env) for i in range(2)]
    processes.worker("w1", concurrency=16, **ENV)
    tokens = {"a": token_for(alice), "b": token_for(bob)}

    # When each team's clients make three calls each, one after the other...
    def client(i: int) -> list[int]:
        slug = "ab"[i % 2]
        return [call(apis[(i // 2) % 2], tokens[slug])[0] for _ in range(3)]

    with ThreadPoolExecutor(16) as pool:
        statuses = [s for row in pool.map(client, range(16)) for s in row]

    # Then no call of team a started while a call of team b had been waiting for a slot: the
    # order is fair share's, whoever claimed.
    assert statuses == [200] * 48
    first_start = dict(
        JobEvent.objects.filter(event="started").values("job_id").annotate(at=Min("at")).values_list("job_id", "at")
    )
    rows = list(Job.objects.values_list("pk", "team__slug", "submitted_at"))
    starts = {pk: first_start[pk] for pk, _, _ in rows}
    margin = timedelta(milliseconds=30)  # a submit's time is taken before its commit
    jumped = [
        (a_pk, b_pk)
        for a_pk, a_slug, _ in rows
        if a_slug == "a"
        for b_pk, b_slug, b_submitted in rows
        if b_slug == "b" and b_submitted + margin < starts[a_pk] < starts[b_pk]
    ]
    assert not jumped, f"team a's calls started before team b's waiting ones: {jumped[:5]}"
    # ...while b's calls really waited behind busy slots, and a's got the slots b left.
    waits = [starts[pk] - submitted for pk, slug, submitted in rows if slug == "b"]
    assert max(waits) > timedelta(milliseconds=100)
    assert http_json(f"{server}/stats")["prefixes"]["x"]["peak"] == 2
    if one_hop == "1":
        assert in_process(Job.objects.all()) >= 1
    else:
        assert in_process(Job.objects.all()) == 0


def test_an_api_process_killed_mid_call_leaves_its_job_to_recovery(processes, make_user, make_team):
    # Given a slow model, a team cap of one slot, short leases, an API process and a worker...
    server = processes.simllm(latency_ms=3000)
    Executor.objects.create(
        name="x", kind="local-model", endpoint=f"{server}/x/v1", capabilities={"models": ["m"]}, max_concurrency=4
    )
    alice = member(make_user, "alice")
    team = make_team("a", {alice: "member"})
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=1)
    lease = {"TELEMACHUS_LEASE_SECONDS": "2"}
    api = processes.api_server("api", **ENV, **lease)
    processes.worker("w1", concurrency=4, lease=2, **ENV)
    token = token_for(alice)
    outcome: dict = {}

    def doomed_call() -> None:
        try:
            outcome["answer"] = call(api, token)
        except OSError as exc:
            outcome["error"] = exc

    failed_call = threading.Thread(target=doomed_call, daemon=True)

    # When the API process runs the call itself and is SIGKILLed while the model answers...
    failed_call.start()
    job = wait_until(
        lambda: Job.objects.filter(team=team, status="running", worker__startswith="api:").first(),
        timeout=20,
        what="the API process to claim its call",
    )
    wait_until(lambda: http_json(f"{server}/stats")["in_flight"] == 1, timeout=10, what="the model call")
    (api_process,) = [p for p in processes.procs if "telemachus.serve" in p.args]
    api_process.send_signal(signal.SIGKILL)
    api_process.wait(timeout=10)
    failed_call.join(timeout=10)

    # Then the lease runs out, recovery requeues the job and frees its slot (the team's only one),
    # and the worker runs it to the end: done once, never completed twice.
    with SlotSampler() as sampler:
        wait_until(
            lambda: Job.objects.get(pk=job.pk).status == "done", timeout=30, interval=0.2, what="the job to finish"
        )
    job.refresh_from_db()
    assert job.attempts == 2 and job.worker == "w1"
    events = list(job.events.order_by("id").values_list("event", flat=True))
    assert events.count("finished") == 1 and "finish_refused" not in events and "failed" not in events
    (requeued,) = job.events.filter(event="requeued")
    assert requeued.meta["reason"] == "lease expired" and requeued.meta["worker"].startswith("api:")
    assert sampler.peak["team"][team.pk] <= 1
    assert not Slot.objects.exists()
    stats = http_json(f"{server}/stats")
    assert stats["requests"] == 2 and stats["in_flight"] == 0
    assert isinstance(outcome.get("error"), OSError), "the killed process's client lost its connection"


def worker_listens() -> bool:
    """Whether a session of the test database has LISTENed and is idle: the worker's listener,
    which hears a NOTIFY sent from then on (the only session here that LISTENs)."""
    with postgres_session() as session:
        row = session.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN%' AND state = 'idle'"
        ).fetchone()
    return bool(row and row[0])


def test_calls_an_api_process_leaves_queued_wake_the_workers_at_once(processes, make_user, make_team):
    # Given an idle worker and two queued calls whose submits woke nobody (their API process was
    # about to claim them)...
    server = processes.simllm(latency_ms=0)
    Executor.objects.create(
        name="x", kind="local-model", endpoint=f"{server}/x/v1", capabilities={"models": ["m"]}, max_concurrency=4
    )
    alice = member(make_user, "alice")
    make_team("a", {alice: "member"})
    processes.worker("w1", concurrency=4, **ENV)
    wait_until(worker_listens, timeout=30, interval=0.05, what="the worker to LISTEN for wake-ups")
    jobs = [
        job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            wake=False,
        )
        for _ in range(2)
    ]

    # When the process claims only the second, which is not next in order (nothing is taken)...
    assert job_claim(worker="api:h:1", limit=1, only={jobs[1].pk}).claims == []
    left_at = time.monotonic()

    # Then the worker runs both at once, woken by that claim.
    wait_until(
        lambda: Job.objects.filter(pk__in=[j.pk for j in jobs], status="done").count() == 2,
        timeout=10,
        interval=0.02,
        what="the worker to run the calls",
    )
    assert time.monotonic() - left_at < 0.5
