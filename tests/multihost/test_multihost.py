"""Telemachus on several hosts: two API hosts and two worker hosts on one PostgreSQL and one Redis,
each host a network namespace with its own address (tests/multihost/netns.py), set up as
docs/deploy.md says (tests/multihost/cluster.py).

Run with `bin/multihost-test` (root, `ip`, socat, PostgreSQL and Redis on the loopback); the
regular suite skips it unless TELEMACHUS_MULTIHOST=1."""

import os
import re
import shutil
import signal
import time
from collections import Counter
from datetime import UTC, datetime

import pytest
from django.db.models import Count

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from tests.concurrency.slots import SlotSampler
from tests.credentials import token_for
from tests.multihost.cluster import API_HOSTS, HOSTS, MODEL_PORT, WORKER_CONCURRENCY, WORKER_HOSTS, Cluster
from tests.processes import wait_until

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(os.environ.get("TELEMACHUS_MULTIHOST") != "1", reason="set TELEMACHUS_MULTIHOST=1 (root)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
    pytest.mark.skipif(not (shutil.which("ip") and shutil.which("socat")), reason="needs ip (iproute2) and socat"),
]

EXECUTOR_CAP, GAMMA_CAP = 4, 1
ALPHA_JOBS, GAMMA_JOBS, BETA_JOBS = 24, 6, 24
# As many as the two worker hosts run at once.
SLOW_JOBS = 4


@pytest.fixture
def cluster(tmp_path):
    redis = os.environ.get("TELEMACHUS_MULTIHOST_REDIS", "127.0.0.1:6379")
    hosts = Cluster(tmp_path, redis_upstream=redis, redis_db=int(os.environ.get("TELEMACHUS_MULTIHOST_REDIS_DB", "11")))
    try:
        yield hosts
    finally:
        hosts.stop()
        print(hosts.log_tails())  # shown by pytest when the test failed


@pytest.fixture
def people(make_user, make_team):
    """alice in alpha (weight 1), bob in beta (weight 3), carol in gamma (weight 1, at most one job
    at once), an operator; a fast model `m` on llm1 with 4 slots and a slow, streaming model `slow`
    on llm2 with 8."""
    alice, bob, carol = make_user("alice"), make_user("bob"), make_user("carol")
    operator = make_user("operator", is_superuser=True, is_staff=True)
    for slug, user in (("alpha", alice), ("beta", bob), ("gamma", carol)):
        make_team(slug, {user: "member"})
    QueuePolicy.objects.update_or_create(pk=1, defaults={"team_weights": {"beta": 3}})
    QuotaPolicy.objects.create(scope="team", subject="gamma", dimension="ai.concurrency", limit=GAMMA_CAP)
    fast = Executor.objects.create(
        name="llm-a",
        kind="local-model",
        endpoint=f"http://10.184.0.{HOSTS['llm1']}:{MODEL_PORT}/v1",
        capabilities={"models": ["m"]},
        max_concurrency=EXECUTOR_CAP,
    )
    slow = Executor.objects.create(
        name="llm-b",
        kind="local-model",
        endpoint=f"http://10.184.0.{HOSTS['llm2']}:{MODEL_PORT}/v1",
        capabilities={"models": ["slow"]},
        max_concurrency=SLOW_JOBS,
    )
    tokens = {u.username: token_for(u) for u in (alice, bob, carol, operator)}
    return tokens, fast, slow


def submit(cluster, index: int, token: str, team: str, model: str, text: str, **input_extra):
    """Through api1 and api2 in turn, by /api/jobs/ and by /v1/chat/completions in turn."""
    host = API_HOSTS[index % 2]
    if index // 2 % 2 == 0:
        body = {
            "type": "chat",
            "team": team,
            "requirements": {"model": model, "est_tokens": 50},
            "input": {"messages": [{"role": "user", "content": text}], "max_tokens": 16, **input_extra},
        }
        return cluster.request(host, "POST", "/api/jobs/", token=token, body=body)
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    return cluster.request(host, "POST", "/v1/chat/completions", token=token, body=body)


def job_id(response) -> int:
    if isinstance(response.body, dict) and "id" in response.body and "choices" not in response.body:
        return response.body["id"]
    return int(response.headers["x-telemachus-job"])


def statuses(ids) -> dict[str, int]:
    return dict(Job.objects.filter(pk__in=ids).values_list("status").annotate(n=Count("id")))


def finished_once(ids) -> bool:
    finished = Counter(JobEvent.objects.filter(event="finished", job__in=ids).values_list("job_id", flat=True))
    return set(finished) == set(ids) and set(finished.values()) == {1}


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_two_api_hosts_and_two_worker_hosts_share_caps_streams_recovery_and_metrics(cluster, people):
    tokens, fast, slow = people
    started = time.monotonic()
    cluster.start(
        models={
            "llm1": {"latency-ms": "600", "models": "m"},
            "llm2": {"latency-ms": "2500", "tokens-per-s": "8", "output-tokens": "16", "models": "slow"},
        }
    )
    print(f"hosts up in {time.monotonic() - started:.1f}s")

    # --- 1. Caps and fair share, with the load coming through both API hosts ---------------------
    # Given alpha's 24 jobs and gamma's 6 queued first (FIFO would run all of them before any of
    # beta's), then beta's 24; the executor's 4 slots bind, and so does gamma's cap of 1 (its fair
    # share would be 2 while alpha and gamma alone have work).
    with SlotSampler() as sampler:
        first = [submit(cluster, i, tokens["alice"], "alpha", "m", f"alpha {i}") for i in range(ALPHA_JOBS)]
        first += [submit(cluster, i, tokens["carol"], "gamma", "m", f"gamma {i}") for i in range(GAMMA_JOBS)]
        wait_until(
            lambda: Job.objects.filter(team__slug__in=["alpha", "gamma"]).count() == ALPHA_JOBS + GAMMA_JOBS,
            timeout=30,
            what="alpha's and gamma's jobs to be queued",
        )
        beta_submitted = time.time()
        later = [submit(cluster, i, tokens["bob"], "beta", "m", f"beta {i}") for i in range(BETA_JOBS)]
        answers = [future.result(timeout=120) for future in first + later]
        ids = [job_id(answer) for answer in answers]
        wait_until(lambda: statuses(ids) == {"done": len(ids)}, timeout=60, interval=0.2, what="the load to finish")

    # Then every call was answered, and every job ran once, on the one model server...
    assert {answer.status for answer in answers} <= {200, 201}, [a.body for a in answers if a.status >= 300]
    assert len(set(ids)) == ALPHA_JOBS + GAMMA_JOBS + BETA_JOBS
    assert finished_once(ids)
    model = cluster.request("llm1", "GET", "/stats").result()
    assert model.body["requests"] == len(ids) and set(model.body["jobs"].values()) == {1}
    # ...which never saw more calls at once than the executor's cap, though the load pressed on it,
    assert model.body["peak"] == EXECUTOR_CAP, model.body
    assert sampler.samples > 50
    assert sampler.peak["executor"][fast.pk] == EXECUTOR_CAP
    # gamma never held more than its cap, though it waited with slots free for it,
    gamma = Job.objects.filter(team__slug="gamma").values_list("team_id", flat=True).first()
    assert sampler.peak["team"][gamma] == GAMMA_CAP
    # several hosts claimed under those caps (a worker host holds at most WORKER_CONCURRENCY calls,
    # so the cap's peak took more than one), each a worker host or an API host running a /v1/
    # call it held (one hop: scheduler/gateway/onehop.py),
    claimers = set(Job.objects.filter(pk__in=ids).values_list("worker", flat=True))
    assert WORKER_CONCURRENCY < EXECUTOR_CAP and len(claimers) >= 2 and claimers & set(WORKER_HOSTS), claimers
    assert all(name.startswith("api:") for name in claimers - set(WORKER_HOSTS)), claimers
    # and beta (weight 3) was served ahead of alpha's older backlog: of the starts from beta's
    # first submit until one of the two had nothing left, most were beta's (FIFO: none).
    since = datetime.fromtimestamp(beta_submitted, tz=UTC)
    order = list(
        Job.objects.filter(pk__in=ids, team__slug__in=["alpha", "beta"], started_at__gte=since)
        .order_by("started_at", "id")
        .values_list("team__slug", flat=True)
    )
    left = Counter(order)
    contended = []
    for slug in order:
        contended.append(slug)
        left[slug] -= 1
        if not left[slug]:
            break
    share = contended.count("beta") / len(contended)
    assert 0.6 <= share, (share, contended)
    print(f"load: {len(ids)} jobs through 2 API hosts in {time.monotonic() - started:.1f}s; beta's share {share:.2f}")

    # --- 2. An SSE stream on api1 shows a job submitted on api2 and run on a worker host ---------
    submitted = cluster.request(
        "api2",
        "POST",
        "/api/jobs/",
        token=tokens["bob"],
        body={
            "type": "chat",
            "team": "beta",
            "requirements": {"model": "slow", "est_tokens": 50},
            "input": {"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 16, "stream": True},
        },
    ).result()
    assert submitted.status == 201, submitted.body
    stream = cluster.stream("api1", submitted.body["id"], token=tokens["bob"])
    # api1 takes the job's output from the channel layer: it joined the job's group in Redis.
    wait_until(
        lambda: cluster.redis_group_exists(f"job-{submitted.body['id']}"),
        timeout=10,
        what="api1 to join the job's group in Redis",
    )
    streamed = stream.result(timeout=60)
    kinds = [kind for _, kind, _ in streamed]
    events = [data["event"] for _, kind, data in streamed if kind == "event"]
    deltas = [(at, data["text"]) for at, kind, data in streamed if kind == "delta"]
    done_at, _, done = streamed[-1]
    assert kinds[0] == "job" and kinds[-1] == "done" and done["status"] == "done"
    job = Job.objects.get(pk=submitted.body["id"])
    assert job.worker in WORKER_HOSTS and job.executor_id == slow.pk
    assert "started" in events and "finished" in events
    # The text came as the model wrote it (16 tokens at 8 per second), relayed from the worker
    # host to api1 through Redis, before the job's end.
    assert len(deltas) >= 3
    assert deltas[-1][0] - deltas[0][0] > 1.0
    assert deltas[0][0] < job.finished_at.timestamp()
    assert "sim15" in "".join(text for _, text in deltas)

    # --- 3. A worker host killed mid-run: the other recovers its jobs ----------------------------
    cluster.request("llm2", "POST", "/stats/reset").result()
    calls = [submit(cluster, i, tokens["alice"], "alpha", "slow", f"slow {i}") for i in range(SLOW_JOBS)]
    wait_until(
        lambda: Job.objects.filter(model="slow", status="running").count() == SLOW_JOBS,
        timeout=30,
        what="the slow jobs to run",
    )
    held = Counter(Job.objects.filter(model="slow", status="running").values_list("worker", flat=True))
    # The worker host holding the most (an API host may hold the /v1/ calls it ran itself).
    victim = max(WORKER_HOSTS, key=lambda host: held[host])
    assert held[victim] >= 1, held
    rescuer = next(host for host in WORKER_HOSTS if host != victim)
    doomed = set(Job.objects.filter(status="running", worker=victim).values_list("pk", flat=True))
    time.sleep(1)  # mid-run: the model takes 2.5 s to start answering
    cluster.procs[victim].send_signal(signal.SIGKILL)
    cluster.procs[victim].wait(timeout=10)
    killed_at = time.monotonic()
    answers = [call.result(timeout=90) for call in calls]
    slow_ids = [job_id(answer) for answer in answers]
    wait_until(lambda: statuses(slow_ids) == {"done": SLOW_JOBS}, timeout=60, interval=0.2, what="recovery")
    print(
        f"kill: {victim} held {len(doomed)} of {SLOW_JOBS}; all done {time.monotonic() - killed_at:.1f}s after the kill"
    )

    assert {answer.status for answer in answers} <= {200, 201}
    assert finished_once(slow_ids)
    requeued = set(JobEvent.objects.filter(event="requeued", job__in=slow_ids).values_list("job_id", flat=True))
    assert requeued == doomed
    for job in Job.objects.filter(pk__in=slow_ids):
        assert (job.attempts, job.worker) == ((2, rescuer) if job.pk in doomed else (1, job.worker)), job.pk
    # The model server saw each doomed job twice (the dead worker's call, dropped, then the
    # rescuer's) and every other job once.
    model = cluster.request("llm2", "GET", "/stats").result()
    assert model.body["jobs"] == {str(pk): 2 if pk in doomed else 1 for pk in slow_ids}
    assert model.body["disconnects"] == len(doomed)
    assert not Slot.objects.exists()

    # --- 4. /metrics on each API host, each counting what it served in its own directory ---------
    done_jobs = Job.objects.filter(status="done").count()
    for host in API_HOSTS:
        ready = cluster.request(host, "GET", "/readyz").result()
        assert ready.status == 200 and ready.body["checks"] == {"database": "ok", "migrations": "ok"}
        expected = cluster.sent[host]
        scrape = cluster.request(host, "GET", "/metrics", token=tokens["operator"]).result()
        assert scrape.status == 200, scrape.body
        assert metric_sum(scrape.body, "telemachus_http_responses_total") == expected, host
        assert metric_sum(scrape.body, "telemachus_jobs_finished_total", outcome="done") == done_jobs
        pids = {int(p.stem.rsplit("_", 1)[1]) for p in (cluster.workdir / host / "prometheus").glob("*.db")}
        assert pids == {cluster.procs[host].pid}, (host, pids)
        page = cluster.request(host, "GET", "/login/").result()
        asset = re.search(r'href="(/static/[^"]+\.css)"', page.body)
        assert page.status == 200 and asset
        assert cluster.request(host, "GET", asset.group(1)).result().status == 200
    assert cluster.request(rescuer, "GET", "/readyz").result().status == 200
    scrape = cluster.request(rescuer, "GET", "/metrics").result()
    assert scrape.status == 200
    beats = re.findall(r'telemachus_worker_heartbeat_timestamp_seconds\{worker="([^"]+)"\}', scrape.body)
    assert beats == [rescuer]
    print(f"total {time.monotonic() - started:.1f}s")
