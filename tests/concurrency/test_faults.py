"""The fault suite: real worker processes, a real model server and PostgreSQL, under the faults a
production cluster meets. Workers SIGKILLed by the dozen, a worker frozen past its lease and then
thawed, database connections cut fifty times, the database itself restarted. Whatever happens: no
job is lost, none finishes twice, no cap is exceeded (in the database and on the wire), and
everything recovers by itself.

Restarting PostgreSQL disturbs everyone using the server, so that test runs only with
TELEMACHUS_FAULT_RESTART_PG=1 (CI sets it)."""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import OperationalError, connection
from django.db.models import Count

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.submit import job_submit
from tests.concurrency.sessions import postgres_session
from tests.concurrency.test_caps import SlotSampler
from tests.credentials import token_for
from tests.processes import answers, free_port, http_json, wait_until
from tests.scheduler.gateway.conftest import may_chat

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LEASE = 3  # seconds: a dead worker's jobs come back this long after it stops heartbeating


def submit_many(users_teams: list[tuple], n: int) -> list[int]:
    ids = []
    for i in range(n):
        user, team = users_teams[i % len(users_teams)]
        ids.append(
            job_submit(
                user=user,
                team=team,
                type="chat",
                requirements={"model": "m", "est_tokens": 10},
                input={"messages": [{"role": "user", "content": f"job {i}"}], "max_tokens": 4},
            ).pk
        )
    return ids


def db(read, *, attempts: int = 60):
    """Run a read from the test process, reconnecting while the database is away."""
    for _ in range(attempts):
        try:
            return read()
        except OperationalError:
            connection.close()
            time.sleep(0.5)
    return read()


def statuses() -> dict[str, int]:
    return db(lambda: dict(Job.objects.values_list("status").annotate(n=Count("id"))))


def assert_each_finished_once(job_ids: list[int]) -> None:
    assert statuses() == {"done": len(job_ids)}, "a job was lost or failed"
    finished = Counter(JobEvent.objects.filter(event="finished").values_list("job_id", flat=True))
    assert set(finished) == set(job_ids), "a job has no finished event"
    twice = {job_id: n for job_id, n in finished.items() if n != 1}
    assert not twice, f"jobs finished more than once: {twice}"
    assert not Slot.objects.exists()


@pytest.fixture
def never_give_up():
    """Faults requeue jobs many times here; none may fail for running out of attempts."""
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 100})


def test_sigkill_storm_loses_nothing_finishes_nothing_twice_and_keeps_every_cap(
    processes, make_user, make_team, never_give_up
):
    # Given two executors on a real model server (counted apart by path), caps at every scope that
    # bind under the load of four workers, and 1,000 jobs from three users of two teams...
    base = processes.simllm(latency_ms=120)
    e1 = Executor.objects.create(
        name="e1", kind="local-model", endpoint=f"{base}/e1/v1", capabilities={"models": ["m"]}, max_concurrency=6
    )
    e2 = Executor.objects.create(
        name="e2", kind="local-model", endpoint=f"{base}/e2/v1", capabilities={"models": ["m"]}, max_concurrency=4
    )
    a1, a2, b1 = make_user("a1"), make_user("a2"), make_user("b1")
    team_a, _ = make_team("a", {a1: "member", a2: "member"}), make_team("b", {b1: "member"})
    caps = {"global": 8, "team": 5, "user": 3}
    QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=caps["global"])
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.concurrency", limit=caps["team"])
    QuotaPolicy.objects.create(scope="user", subject="a1", dimension="ai.concurrency", limit=caps["user"])
    job_ids = submit_many([(a1, "a"), (a2, "a"), (b1, "b")], 1000)
    sampler = SlotSampler()
    sampler.start()

    # When four workers drain the queue while one of them is SIGKILLed every 0.7 s (24 kills,
    # each replaced by a fresh worker), mid-claim, mid-dispatch or mid-finish...
    live = {f"w{i}": processes.worker(f"w{i}", concurrency=8, lease=LEASE) for i in range(4)}
    killed: list[str] = []
    try:
        wait_until(lambda: Job.objects.filter(status="done").exists(), timeout=60, what="work to start")
        for round_ in range(24):
            time.sleep(0.7)
            name = sorted(live)[round_ % len(live)]
            live.pop(name).send_signal(signal.SIGKILL)
            killed.append(name)
            fresh = f"w{4 + round_}"
            live[fresh] = processes.worker(fresh, concurrency=8, lease=LEASE)
        storm_done = db(lambda: Job.objects.filter(status="done").count())
        wait_until(lambda: statuses() == {"done": 1000}, timeout=300, interval=0.5, what="all 1,000 jobs done")
    finally:
        sampler.stop.set()
        sampler.join()

    # Then nothing was lost or finished twice...
    assert len(killed) == 24 and len(set(killed)) >= 20
    assert storm_done < 1000, "the storm must hit a queue still being worked"
    assert_each_finished_once(job_ids)
    requeued = JobEvent.objects.filter(event="requeued", meta__reason="lease expired").count()
    assert requeued > 0, "killed workers held jobs that recovery gave back"
    # ...and no cap was ever exceeded, in the database or on the wire, while the caps did bind.
    stats = http_json(f"{base}/stats")
    assert stats["peak"] <= caps["global"]
    assert stats["prefixes"]["e1"]["peak"] <= 6 and stats["prefixes"]["e2"]["peak"] <= 4
    assert sampler.samples > 50
    assert sampler.peak_total <= caps["global"]
    assert sampler.peak["executor"][e1.pk] <= 6 and sampler.peak["executor"][e2.pk] <= 4
    assert sampler.peak["team"][team_a.pk] <= caps["team"]
    assert sampler.peak["user"][a1.pk] <= caps["user"]
    assert sampler.peak_total == caps["global"] and sampler.peak["user"][a1.pk] == caps["user"]
    assert all(proc.poll() is None for proc in live.values()), "the survivors are still running"


def test_a_worker_frozen_past_its_lease_has_no_write_accepted_when_it_thaws(processes, member_setup):
    # Given a worker holding three jobs on a model server that answers in 2 s...
    alice = member_setup[0]
    base = processes.simllm(latency_ms=2000)
    Executor.objects.filter(name="shared").update(enabled=False)
    Executor.objects.create(
        name="slow", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["m"]}, max_concurrency=3
    )
    job_ids = submit_many([(alice, "a")], 3)
    frozen = processes.worker("frozen", concurrency=3, lease=LEASE)
    wait_until(
        lambda: Job.objects.filter(status="running", worker="frozen").count() == 3,
        timeout=30,
        what="the worker to hold three jobs",
    )

    # When it is SIGSTOPped, its lease runs out, another worker takes the jobs over and finishes
    # them, and only then is the first one SIGCONTed (its model calls answered meanwhile)...
    frozen.send_signal(signal.SIGSTOP)
    rescuer = processes.worker("rescuer", concurrency=3, lease=LEASE)
    wait_until(lambda: statuses() == {"done": 3}, timeout=60, interval=0.2, what="the rescuer to finish the jobs")
    frozen.send_signal(signal.SIGCONT)

    def refused_or_aborted() -> bool:
        text = frozen.log_path.read_text()
        return all(
            f"job {i}: result refused" in text or f"job {i} dispatch aborted: lease lost" in text for i in job_ids
        )

    wait_until(refused_or_aborted, timeout=30, what="the thawed worker to be refused or to give up")
    time.sleep(LEASE)  # a heartbeat or two more from the thawed worker

    # Then every job finished once, by the rescuer: nothing the thawed worker wrote was accepted.
    assert_each_finished_once(job_ids)
    assert set(Job.objects.values_list("worker", flat=True)) == {"rescuer"}
    assert set(Job.objects.values_list("attempts", flat=True)) == {2}
    refused = JobEvent.objects.filter(event="finish_refused").values_list("job_id", "meta__reason")
    assert all(reason in {"job is done", "lease lost"} for _, reason in refused), refused
    assert frozen.poll() is None and rescuer.poll() is None


def test_fifty_cut_connections_cost_nothing(processes, make_user, make_team, never_give_up):
    # Given three workers draining 400 jobs from a real model server...
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    base = processes.simllm(latency_ms=60)
    Executor.objects.create(
        name="e", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["m"]}, max_concurrency=12
    )
    job_ids = submit_many([(alice, "a")], 400)
    workers = [
        processes.worker(f"w{i}", concurrency=8, lease=LEASE, PGAPPNAME="telemachus-fault-worker") for i in range(3)
    ]
    wait_until(lambda: Job.objects.filter(status="done").exists(), timeout=60, what="work to start")

    # When every database connection of the workers (queries and LISTEN) is terminated, 50 times
    # (from a session of the test's own on PostgreSQL: through a pooler, the test's statement could
    # land on a server connection that last served a worker, and terminate itself)...
    cut = 0
    with postgres_session() as session:
        for _ in range(50):
            cut += session.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = 'telemachus-fault-worker'"
            ).fetchone()[0]
            time.sleep(0.15)

    # Then the workers reconnect by themselves and make progress within 30 s...
    assert cut >= 50
    before = Job.objects.filter(status="done").count()
    wait_until(
        lambda: Job.objects.filter(status="done").count() > before or before == 400,
        timeout=30,
        interval=0.2,
        what="progress after the last cut",
    )
    # ...and finish everything, each job once.
    wait_until(lambda: statuses() == {"done": 400}, timeout=120, interval=0.5, what="all jobs done")
    assert_each_finished_once(job_ids)
    assert all(w.poll() is None for w in workers)


def test_in_flight_calls_get_their_answers_when_the_api_processs_connections_are_cut(
    processes, make_user, make_team, never_give_up
):
    # Given an API process (as bin/run serves it), a worker, and sixteen /v1/ calls in flight on a
    # model server that takes five seconds to answer...
    alice = may_chat(make_user("alice"))
    make_team("a", {alice: "member"})
    base = processes.simllm(latency_ms=5000)
    Executor.objects.create(
        name="e", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["m"]}, max_concurrency=16
    )
    api = processes.api_server("api", PGAPPNAME="telemachus-fault-api", TELEMACHUS_PROBE_INTERVAL_SECONDS="3600")
    processes.worker("w1", concurrency=16, lease=LEASE)
    token = token_for(alice)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()

    def call(_: int) -> tuple[int, str | None]:
        request = urllib.request.Request(
            f"{api}/v1/chat/completions",
            data=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.headers.get("x-telemachus-job")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("x-telemachus-job")

    with ThreadPoolExecutor(16) as pool:
        calls = [pool.submit(call, i) for i in range(16)]
        wait_until(lambda: Job.objects.count() == 16, timeout=30, what="all calls submitted")
        in_flight = Job.objects.exclude(status="done").count()

        # When every database connection of the API process (its shared threads, its claims and
        # its LISTEN) is terminated three times while the model works...
        cut = 0
        with postgres_session() as session:
            for _ in range(3):
                cut += session.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'telemachus-fault-api'"
                ).fetchone()[0]
                time.sleep(0.3)
        answers = [future.result() for future in calls]

    # Then every call gets its answer, with its job's id, and each job finished once.
    assert cut >= 3 and in_flight >= 8, (cut, in_flight)
    assert [status for status, _ in answers] == [200] * 16, answers
    job_ids = [int(job_id) for _, job_id in answers]
    assert_each_finished_once(job_ids)


def pg_version() -> str:
    return sorted(os.listdir("/etc/postgresql"))[0]


def restart_postgres() -> None:
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", pg_version(), "main", "restart"],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.mark.skipif(
    os.environ.get("TELEMACHUS_FAULT_RESTART_PG") != "1",
    reason="restarts the shared PostgreSQL server: set TELEMACHUS_FAULT_RESTART_PG=1 (CI does)",
)
@pytest.mark.skipif(
    shutil.which("pg_ctlcluster") is None or not os.path.isdir("/etc/postgresql"), reason="needs pg_ctlcluster"
)
def test_postgres_restarted_three_times_mid_run(processes, make_user, make_team, never_give_up, api):
    # Given the API (as bin/run serves it) and two workers draining 300 jobs...
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    base = processes.simllm(latency_ms=100)
    Executor.objects.create(
        name="e", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["m"]}, max_concurrency=8
    )
    token = api(alice)._credentials["HTTP_AUTHORIZATION"]
    port = free_port()
    processes.spawn("api", "-m", "telemachus.serve", "127.0.0.1", str(port))
    queue_url = f"http://127.0.0.1:{port}/api/queue/"
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/api/schema/"), timeout=30, what="the API to listen")
    job_ids = submit_many([(alice, "a")], 300)
    workers = [processes.worker(f"w{i}", concurrency=8, lease=LEASE) for i in range(2)]
    wait_until(lambda: Job.objects.filter(status="done").exists(), timeout=60, what="work to start")

    def api_answers() -> bool:
        request = urllib.request.Request(queue_url, headers={"Authorization": token})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def done() -> int:
        return db(lambda: Job.objects.filter(status="done").count())

    # When PostgreSQL is restarted three times while they work...
    for _ in range(3):
        before = done()
        restart_postgres()
        restarted = time.monotonic()
        connection.close()
        # Then within 30 s the API answers again and the workers make progress, by themselves.
        wait_until(api_answers, timeout=30, interval=0.5, what="the API to answer after the restart")
        wait_until(
            lambda before=before: done() > before or done() == 300,
            timeout=30 - (time.monotonic() - restarted),
            interval=0.5,
            what="the workers to make progress after the restart",
        )

    # And in the end nothing was lost and nothing finished twice.
    wait_until(lambda: statuses() == {"done": 300}, timeout=120, interval=0.5, what="all jobs done")
    assert_each_finished_once(job_ids)
    assert all(w.poll() is None for w in workers)
