"""GET /metrics after a scripted run: a real worker (in this process, so its own histograms are
visible without multiprocess mode) drains a queue under a team cap; the scrape shows the state
and the totals with their names, labels and values. And the health endpoints."""

import asyncio
import json
import signal
import time
import urllib.request

import pytest
from asgiref.testing import ApplicationCommunicator
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder
from prometheus_client.parser import text_string_to_metric_families

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.metrics import (
    CLAIM_SECONDS,
    DISPATCH_SECONDS,
    HTTP_RESPONSES,
    WORKER_HEARTBEAT,
    ResponseCounter,
    worker_heartbeat_forget,
    worker_heartbeat_observe,
)
from scheduler.models import Job
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from scheduler.worker.runner import Worker
from telemachus.http import health
from tests.credentials import token_for
from tests.processes import free_port, wait_until


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200, response.content[:500]
    assert response["Content-Type"].startswith("text/plain; version=")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.content.decode())
        for sample in family.samples
    }


def sample_count(histogram, **labels) -> float:
    metric = histogram.labels(**labels) if labels else histogram
    return next(s.value for s in metric.collect()[0].samples if s.name.endswith("_count"))


@pytest.mark.django_db(transaction=True)
def test_names_labels_and_values_after_a_scripted_run(api, operator, member_setup, make_executor):
    alice, bob, *_ = member_setup
    Executor.objects.filter(name="shared").update(meta={"latency_ms": 5, "output_tokens": 7})
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=2)
    QuotaPolicy.objects.create(scope="team", subject="b", dimension="ai.tokens", limit=100000, window="day")
    idle = make_executor("idle", models=["other"])
    claims_before = sample_count(CLAIM_SECONDS)
    dispatches_before = sample_count(DISPATCH_SECONDS, executor="shared", outcome="ok")

    def submit(user, team, model="m", priority=0):
        return job_submit(
            user=user,
            team=team,
            type="chat",
            priority=priority,
            requirements={"model": model},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )

    for _ in range(3):
        submit(alice, "a")
    job_cancel(job_id=submit(alice, "a").pk)
    asyncio.run(Worker(name="metrics-w", concurrency=4, burst=True).run())
    submit(bob, "b", model="other", priority=5)
    Executor.objects.filter(pk=idle.pk).update(enabled=False)  # so it waits
    assert Job.objects.filter(status="done").count() == 3

    samples = scrape(api(operator))

    assert samples["telemachus_jobs_finished_total", (("outcome", "done"), ("team", "a"), ("type", "chat"))] == 3
    assert samples["telemachus_jobs_finished_total", (("outcome", "canceled"), ("team", "a"), ("type", "chat"))] == 1
    assert samples["telemachus_tokens_billed_total", (("team", "a"),)] == sum(
        Job.objects.filter(team__slug="a").values_list("tokens_used", flat=True).exclude(tokens_used=None)
    )
    assert samples["telemachus_tokens_billed_total", (("team", "a"),)] > 0
    assert samples["telemachus_queue_depth", (("priority", "5"), ("team", "b"))] == 1
    assert ("telemachus_queue_depth", (("priority", "0"), ("team", "a"))) not in samples
    assert samples["telemachus_job_wait_seconds_count", (("team", "a"),)] == 3
    assert samples["telemachus_job_wait_seconds_bucket", (("le", "+Inf"), ("team", "a"))] == 3
    assert samples["telemachus_job_wait_seconds_sum", (("team", "a"),)] >= 0
    assert samples["telemachus_slots_cap", (("scope", "team"), ("subject", "a"))] == 2
    assert samples["telemachus_slots_in_use", (("scope", "global"), ("subject", ""))] == 0
    assert samples["telemachus_slots_cap", (("scope", "executor"), ("subject", "shared"))] == 4
    assert samples["telemachus_executor_health", (("executor", "shared"), ("health", "ok"))] == 1
    assert samples["telemachus_executor_breaker", (("executor", "shared"), ("state", "closed"))] == 1
    assert samples["telemachus_executor_breaker", (("executor", "shared"), ("state", "open"))] == 0
    assert samples["telemachus_executor_enabled", (("executor", "idle"),)] == 0
    assert (
        samples[
            "telemachus_budget_remaining",
            (("dimension", "ai.tokens"), ("scope", "team"), ("subject", "b"), ("window", "day")),
        ]
        == 100000
    )
    assert samples["telemachus_claim_duration_seconds_count", ()] - claims_before >= 1
    assert (
        samples["telemachus_dispatch_latency_seconds_count", (("executor", "shared"), ("outcome", "ok"))]
        - dispatches_before
        == 3
    )


@pytest.mark.django_db
def test_metrics_are_for_operators(api, member_setup, client):
    assert api().get("/metrics").status_code == 401
    response = api(member_setup[0]).get("/metrics")
    assert response.status_code == 403 and response.json()["error"] == "forbidden"


@pytest.mark.django_db
def test_health_and_readiness(client, monkeypatch):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "checks": {"database": "ok", "migrations": "ok"}}

    # A migration not applied yet: not ready, and says which.
    monkeypatch.setattr(health, "_migrated", False)
    ((app, name),) = MigrationLoader(connection).graph.leaf_nodes("telemachus")  # the latest: nothing depends on it
    MigrationRecorder.Migration.objects.filter(app=app, name=name).delete()
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["migrations"] == f"1 not applied (telemachus.{name})"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_serves_probes_and_metrics_on_its_own_address(processes, member_setup):
    port = free_port()
    processes.worker("probed", TELEMACHUS_METRICS_BIND=f"127.0.0.1:{port}")
    base = f"http://127.0.0.1:{port}"

    def get(path):
        try:
            with urllib.request.urlopen(base + path, timeout=5) as response:
                return response.status, response.read()
        except OSError:
            return None

    wait_until(lambda: get("/healthz"), timeout=30, what="the worker's probe server")
    assert json.loads(get("/healthz")[1]) == {"status": "ok"}
    status, body = get("/readyz")
    assert status == 200
    assert json.loads(body)["checks"] == {"database": "ok", "migrations": "ok", "heartbeat": "ok"}
    status, body = get("/metrics")
    assert status == 200 and b"telemachus_queue_depth" in body and b"telemachus_claim_duration_seconds" in body


def series(families, name: str) -> dict[tuple, float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in families
        for sample in family.samples
        if sample.name == name
    }


@pytest.mark.django_db
def test_a_budget_is_served_with_its_limit_beside_what_remains(api, operator, member_setup):
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.requests", limit=40, window="hour")
    samples = scrape(api(operator))
    key = (("dimension", "ai.requests"), ("scope", "team"), ("subject", "a"), ("window", "hour"))
    assert samples["telemachus_budget_limit", key] == 40
    assert samples["telemachus_budget_remaining", key] == 40


def http_responses() -> dict[tuple, float]:
    return series(HTTP_RESPONSES.collect(), "telemachus_http_responses_total")


def test_every_http_response_is_counted_by_code_whoever_answers():
    """Through the whole ASGI app: Django's pages, the gateway's raw answers ahead of Django, and
    an application that fails before answering (the server sends 500)."""
    from telemachus.asgi import application

    async def get(app, path: str) -> int:
        communicator = ApplicationCommunicator(
            app,
            {
                "type": "http",
                "method": "GET",
                "path": path,
                "headers": [(b"host", b"localhost")],
                "query_string": b"",
                "server": ("127.0.0.1", 80),
            },
        )
        await communicator.send_input({"type": "http.request", "body": b""})
        try:
            return (await communicator.receive_output(timeout=10))["status"]
        finally:
            await communicator.wait(timeout=10)

    async def broken(scope, receive, send):
        raise RuntimeError("before any response")

    before = http_responses()
    assert asyncio.run(get(application, "/healthz")) == 200  # Django
    assert asyncio.run(get(application, "/v1/models")) == 401  # the gateway, raw ASGI
    with pytest.raises(RuntimeError):
        asyncio.run(get(ResponseCounter(broken), "/"))
    after = http_responses()
    for code in ("200", "401", "500"):
        assert after[(("code", code),)] - before.get((("code", code),), 0) == 1, code


def test_a_worker_heartbeat_is_its_time_until_it_stops_cleanly():
    worker_heartbeat_observe(worker="beating")
    beats = series(WORKER_HEARTBEAT.collect(), "telemachus_worker_heartbeat_timestamp_seconds")
    assert abs(beats[(("worker", "beating"),)] - time.time()) < 5
    worker_heartbeat_forget(worker="beating")
    assert (("worker", "beating"),) not in series(
        WORKER_HEARTBEAT.collect(), "telemachus_worker_heartbeat_timestamp_seconds"
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_dead_workers_last_beat_stays_and_a_stopped_one_goes(processes, tmp_path, operator, api):
    """As bin/run runs them: the API server and workers sharing a multiprocess directory. A worker that
    stops on SIGTERM takes its series with it; one killed keeps its last beat, which ages, so an
    alert on the age of the beat fires for it and only for it."""
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    base = processes.api_server(PROMETHEUS_MULTIPROC_DIR=str(multiproc))
    stopped = processes.worker("stopped", PROMETHEUS_MULTIPROC_DIR=str(multiproc))
    killed = processes.worker("killed", PROMETHEUS_MULTIPROC_DIR=str(multiproc))
    token = token_for(operator)

    def beats() -> dict[str, float]:
        request = urllib.request.Request(f"{base}/metrics", headers={"Authorization": f"Token {token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            families = list(text_string_to_metric_families(response.read().decode()))
        found = series(families, "telemachus_worker_heartbeat_timestamp_seconds")
        return {dict(labels)["worker"]: value for labels, value in found.items()}

    wait_until(lambda: {"stopped", "killed"} <= set(beats()), timeout=30, what="both workers' heartbeats")
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=30) == 0
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=10)
    last = beats()
    assert set(last) == {"killed"}
    time.sleep(1.5)  # a live worker would have beaten by now (it beats every second without LISTEN)
    assert beats()["killed"] == last["killed"] and time.time() - last["killed"] >= 1.5
