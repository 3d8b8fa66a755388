"""Retries, re-placement, the circuit breaker, probes and cancel, with real worker processes
against real servers on 127.0.0.1 (simllm and the fault server)."""

import pytest
from django.db import connection
from django.utils import timezone

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from tests.processes import free_port, http_json, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

FAST = {"TELEMACHUS_RETRY_BASE_SECONDS": "0.2", "TELEMACHUS_PROBE_INTERVAL_SECONDS": "0.5"}


@pytest.fixture(autouse=True)
def close_connection():
    yield
    connection.close()


@pytest.fixture
def alice(member_setup):
    alice, _, _, _, shared = member_setup
    shared.delete()
    return alice


def executor(name: str, endpoint: str, **fields) -> Executor:
    return Executor.objects.create(
        name=name, kind="local-model", endpoint=endpoint, capabilities={"models": ["m"]}, **fields
    )


def submit(user, n: int = 1, **input_options) -> list[Job]:
    return [
        job_submit(
            user=user,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": f"#{i}"}], **input_options},
        )
        for i in range(n)
    ]


def ended(jobs: list[Job]) -> bool:
    return not Job.objects.filter(pk__in=[j.pk for j in jobs]).exclude(status__in=Job.TERMINAL).exists()


def events(job: Job) -> list[tuple[str, str | None]]:
    return [
        (e.event, e.executor.name if e.executor else None)
        for e in JobEvent.objects.filter(job=job).select_related("executor")
    ]


def executor_events(name: str) -> list[str]:
    return list(JobEvent.objects.filter(executor__name=name, job__isnull=True).values_list("event", flat=True))


@pytest.mark.parametrize("mode", ["400", "401", "403", "404model"])
def test_non_retryable_failures_fail_at_once_with_the_upstream_message(processes, alice, mode):
    faults = processes.faultserver()
    executor("bad", f"{faults}/{mode}/v1")
    (job,) = submit(alice)
    processes.worker("w", **FAST)
    wait_until(lambda: ended([job]), timeout=20, what="the job to end")
    job.refresh_from_db()
    assert job.status == "failed" and job.attempts == 1
    assert f"bad answered {mode[:3]}" in job.error and "upstream says" in job.error or "does not exist" in job.error
    assert not JobEvent.objects.filter(job=job, event="retry_scheduled").exists()
    assert http_json(f"{faults}/stats") == {mode: 1}
    assert not Slot.objects.exists()


def test_retryable_failure_is_retried_on_the_other_executor(processes, alice):
    faults = processes.faultserver()
    good = processes.simllm(latency_ms=0)
    executor("flaky", f"{faults}/503/v1", weight=10)  # least-loaded placement tries the heavier first
    executor("steady", f"{good}/v1", weight=1)
    (job,) = submit(alice)
    processes.worker("w", **FAST)
    wait_until(lambda: ended([job]), timeout=20, what="the job to end")
    job.refresh_from_db()
    assert job.status == "done" and job.attempts == 2 and job.executor.name == "steady"
    assert events(job) == [
        ("queued", None),
        ("placed", "flaky"),
        ("started", "flaky"),
        ("retry_scheduled", "flaky"),
        ("placed", "steady"),
        ("started", "steady"),
        ("finished", "steady"),
    ]
    assert not Slot.objects.exists()


def test_429_waits_at_least_retry_after(processes, alice):
    faults = processes.faultserver()
    executor("limited", f"{faults}/429/v1")
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 2})
    (job,) = submit(alice)
    processes.worker("w", **FAST)
    wait_until(lambda: ended([job]), timeout=20, what="the job to end")
    job.refresh_from_db()
    assert job.status == "failed" and "gave up after 2 attempts" in job.error
    retry = JobEvent.objects.get(job=job, event="retry_scheduled")
    assert retry.meta["delay_s"] >= 1.0
    second_start = JobEvent.objects.filter(job=job, event="started").last()
    assert (second_start.at - retry.at).total_seconds() >= 1.0
    assert not Slot.objects.exists()


@pytest.mark.parametrize(
    ("mode", "input_options", "transport", "error"),
    [
        ("hang", {}, {"timeout_s": 0.5}, "timed out"),
        ("malformed", {}, {}, "malformed completion"),
        ("reset", {"stream": True}, {}, "unreachable"),
        (None, {}, {}, "unreachable"),
    ],
)
def test_exhausted_retries_fail_and_free_the_slot(processes, alice, mode, input_options, transport, error):
    base = processes.faultserver() + f"/{mode}" if mode else f"http://127.0.0.1:{free_port()}"
    # Probed just now, so the worker's probe does not mark it down first (that has its own test).
    executor("bad", f"{base}/v1", transport=transport, last_probed_at=timezone.now())
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 2})
    (job,) = submit(alice, **input_options)
    processes.worker("w", TELEMACHUS_PROBE_INTERVAL_SECONDS="3600", TELEMACHUS_RETRY_BASE_SECONDS="0.2")
    wait_until(lambda: ended([job]), timeout=30, what="the job to end")
    job.refresh_from_db()
    assert job.status == "failed" and job.attempts == 2
    assert error in job.error and "gave up after 2 attempts" in job.error
    assert not Slot.objects.exists()


def test_breaker_opens_half_opens_and_closes(processes, alice, api, operator):
    faults = processes.faultserver()
    executor("switchy", f"{faults}/switch/v1")
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 1})
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=1)
    failing = submit(alice, 3)
    env = {
        "TELEMACHUS_BREAKER_THRESHOLD": "3",
        "TELEMACHUS_BREAKER_COOLDOWN_SECONDS": "2",
        "TELEMACHUS_PROBE_INTERVAL_SECONDS": "3600",
    }
    processes.worker("w", **env)

    # Three faults in a row open the breaker...
    wait_until(lambda: ended(failing), timeout=20, what="three failures")
    wait_until(lambda: Executor.objects.get(name="switchy").breaker == "open", timeout=5, what="the breaker to open")
    # ...and while it is open nothing is placed there.
    http_json(f"{faults}/switch/off", method="POST")
    later = submit(alice, 2)
    assert Job.objects.get(pk=later[0].pk).status == "queued"
    # After the cooldown one trial goes through, succeeds, and closes the breaker; the rest follow.
    wait_until(lambda: ended(later), timeout=20, what="the jobs after the cooldown")
    switchy = Executor.objects.get(name="switchy")
    assert switchy.breaker == "closed" and switchy.consecutive_failures == 0
    assert executor_events("switchy") == ["breaker_opened", "breaker_half_open", "breaker_closed"]
    # Operators see the same transitions through the API.
    listed = api(operator).get(f"/api/executors/{switchy.pk}/events/").json()["results"]
    assert [(e["event"], e["executor"]) for e in listed] == [
        ("breaker_opened", "switchy"),
        ("breaker_half_open", "switchy"),
        ("breaker_closed", "switchy"),
    ]
    opened = JobEvent.objects.get(event="breaker_opened")
    first_start = min(JobEvent.objects.filter(job__in=later, event="started").values_list("at", flat=True))
    assert (first_start - opened.at).total_seconds() >= 2.0
    assert {j.status for j in Job.objects.filter(pk__in=[j.pk for j in later])} == {"done"}
    assert not Slot.objects.exists()


def test_a_failed_trial_reopens_the_breaker(processes, alice):
    faults = processes.faultserver()
    executor("switchy", f"{faults}/switch/v1")
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 1})
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=1)
    jobs = submit(alice, 2)
    processes.worker(
        "w",
        TELEMACHUS_BREAKER_THRESHOLD="1",
        TELEMACHUS_BREAKER_COOLDOWN_SECONDS="1",
        TELEMACHUS_PROBE_INTERVAL_SECONDS="3600",
    )
    wait_until(lambda: ended(jobs), timeout=20, what="both jobs to fail")
    # The worker tells the breaker after the finish commits: the job can read as failed first.
    reopened = ["breaker_opened", "breaker_half_open", "breaker_opened"]
    wait_until(lambda: executor_events("switchy") == reopened, timeout=10, what="the breaker to reopen")
    assert JobEvent.objects.filter(event="breaker_opened").last().meta["trial_failed"] is True


def test_probes_mark_an_unreachable_executor_down_and_back_up(processes, alice):
    port = free_port()
    executor("gone", f"http://127.0.0.1:{port}/v1")
    processes.worker("w", **FAST)
    wait_until(lambda: Executor.objects.get(name="gone").health == "down", timeout=10, what="health down")
    assert executor_events("gone") == ["health_changed"]
    (job,) = submit(alice)
    assert Job.objects.get(pk=job.pk).status == "queued", "a down executor is not placed"

    processes.start(f"simllm-{port}", "simllm", "--port", str(port), "--latency-ms", "0", "--models", "m")
    wait_until(lambda: Executor.objects.get(name="gone").health == "ok", timeout=15, what="health ok")
    wait_until(lambda: ended([job]), timeout=15, what="the job to run once the executor is back")
    assert Executor.objects.get(name="gone").last_seen is not None


def test_cancel_of_a_streamed_job_stops_the_upstream_request(processes, alice):
    base = processes.simllm(latency_ms=0, tokens_per_s=2, output_tokens=200)
    executor("slowstream", f"{base}/v1")
    (job,) = submit(alice, stream=True)
    processes.worker("w", **FAST)
    wait_until(lambda: http_json(f"{base}/stats")["in_flight"] == 1, timeout=20, what="the stream to start")
    job_cancel(job_id=job.pk)
    assert not Slot.objects.exists()
    wait_until(lambda: http_json(f"{base}/stats")["disconnects"] == 1, timeout=5, what="the upstream stream to stop")
    assert Job.objects.get(pk=job.pk).status == "canceled"


def test_a_result_the_database_refuses_fails_only_its_job(processes, alice, on_postgres):
    """PostgreSQL's jsonb cannot hold a NUL character; a model reply with one must fail its own job
    and not block the worker's other results (SQLite stores it: the job is done there)."""
    faults = processes.faultserver()
    good = processes.simllm(latency_ms=0)
    executor("nul", f"{faults}/nul/v1", weight=10, max_concurrency=1)
    executor("fine", f"{good}/v1")
    jobs = submit(alice, 6)
    worker = processes.worker("w", **FAST)
    wait_until(lambda: ended(jobs), timeout=30, what="the jobs to end")
    on_nul = Job.objects.filter(executor__name="nul")
    assert on_nul.exists()
    if on_postgres:
        assert all(j.status == "failed" and "could not be stored" in j.error for j in on_nul)
    assert Job.objects.filter(executor__name="fine", status="done").count() == 6 - on_nul.count()
    assert worker.poll() is None
    assert not Slot.objects.exists()


def test_an_executor_without_a_usable_driver_fails_its_jobs_not_the_worker(processes, alice):
    Executor.objects.create(
        name="ghost", kind="ghost", capabilities={"models": ["m"]}, weight=10, last_probed_at=timezone.now()
    )
    (job,) = submit(alice)
    worker = processes.worker(
        "w", TELEMACHUS_EXECUTOR_DRIVERS="ghost=no.such.module.Driver", TELEMACHUS_PROBE_INTERVAL_SECONDS="3600"
    )
    wait_until(lambda: ended([job]), timeout=20, what="the job to end")
    job.refresh_from_db()
    assert job.status == "failed" and "has no usable driver" in job.error and "no.such.module" in job.error
    good = processes.simllm(latency_ms=0)
    Executor.objects.filter(name="ghost").update(enabled=False)
    executor("fine", f"{good}/v1")
    (after,) = submit(alice)
    wait_until(lambda: ended([after]), timeout=20, what="a later job on a good executor")
    assert Job.objects.get(pk=after.pk).status == "done" and worker.poll() is None
