"""What `make run` does on a fresh machine, end to end with the real settings: migrate, seed the
demo (twice: it must be idempotent and show the admin password once), then bin/run serves the API
and a worker; a job submitted over HTTP ends `done` with the simulated reply; Ctrl-C stops both.

And how bin/run stops with a slow job in flight: one Ctrl-C lets it finish while the API keeps
answering (within a bounded grace, past which the job goes back to the queue); two Ctrl-C give it
back at once. Either way both processes are gone when bin/run returns."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from openai import OpenAI

from tests.processes import ROOT, answers, free_port, wait_until

pytestmark = pytest.mark.slow


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def call(url: str, token: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        method="POST" if body else "GET",
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=40) as response:
        return json.loads(response.read())


def children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid`, but for the `sleep` bin/run polls with
    (a child of it most of the time: counted, it made "daphne and the worker" a race)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().split("(", 1)[1].rsplit(")", 1)
        except (OSError, ValueError):
            continue
        fields = rest.split()
        if int(fields[1]) == pid and fields[0] != "Z" and name != "sleep":
            found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Run:
    """bin/run against a fresh SQLite database in `tmp_path`, with the demo seeded."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.tmp_path = tmp_path
        # The metrics files in the test's directory, not in var/ (an empty value: bin/run's default).
        (tmp_path / "prometheus").mkdir()
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "telemachus.settings",
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": f"sqlite:///{tmp_path}/run.sqlite3",
            "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus"),
            **env,
        }
        self.env.pop("DEBUG", None)
        self.env.pop("REDIS_URL", None)
        manage(self.env, "migrate", "--noinput")
        self.seed_output = manage(self.env, "telemachus_demo")
        self.token = manage(self.env, "drf_create_token", "admin").split()[2]
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}/api"
        self.log_path = tmp_path / "run.log"
        self.proc: subprocess.Popen | None = None

    def start(self, *, sigint_ignored: bool = False) -> None:
        """`sigint_ignored`: as a shell starts a background job, or as some CI runners start steps."""
        log = open(self.log_path, "w")
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.proc = subprocess.Popen(
            ["bin/run"],
            cwd=ROOT,
            env={**self.env, "PY": sys.executable, "PORT": str(self.port)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=ignore,
        )
        wait_until(lambda: answers(f"{self.base}/schema/"), timeout=60, what="the API to listen")
        wait_until(lambda: len(children(self.proc.pid)) == 2, timeout=30, what="daphne and the worker")

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def submit(self, content: str = "Hello") -> dict:
        return call(
            f"{self.base}/jobs/",
            self.token,
            {
                "type": "chat",
                "team": "demo",
                "requirements": {"model": "sim", "est_tokens": 50},
                "input": {"messages": [{"role": "user", "content": content}], "max_tokens": 16},
            },
        )

    def job(self, job_id: int) -> dict:
        return call(f"{self.base}/jobs/{job_id}/", self.token)

    def job_status_in_database(self, job_id: int) -> str:
        return manage(
            self.env, "shell", "-c", f"from scheduler.models import Job; print(Job.objects.get(pk={job_id}).status)"
        ).split()[-1]

    def slow_sim(self, latency_ms: int) -> None:
        manage(
            self.env,
            "shell",
            "-c",
            f"from executors.models import Executor; Executor.objects.filter(name='sim')"
            f".update(meta={{'latency_ms': {latency_ms}}})",
        )

    def stop_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for pid in children(self.proc.pid):
                os.kill(pid, signal.SIGKILL)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@pytest.fixture
def run(tmp_path):
    started = Run(tmp_path)
    yield started
    started.stop_all()


def test_fresh_database_to_a_finished_job_and_a_clean_stop(run):
    second = manage(run.env, "telemachus_demo")
    password = run.seed_output.split("password (shown once): ")[1].split()[0]
    assert "admin user present" in second and password not in second
    run.start()
    # Each process names what it serves: the database, the server, Redis, the metrics directory.
    wait_until(lambda: "Telemachus worker" in run.log_path.read_text(), timeout=30, what="the worker's banner")
    log = run.log_path.read_text()
    assert f"Telemachus API on http://127.0.0.1:{run.port}/, served by uvicorn (DEBUG on)" in log
    assert log.count(f"  database  sqlite {run.tmp_path}/run.sqlite3, embedded: one host only") == 2, log
    assert log.count("  redis     none: in-memory channel layer") == 2
    assert log.count(f"  metrics   {run.tmp_path}/prometheus (PROMETHEUS_MULTIPROC_DIR") == 2
    with urllib.request.urlopen(f"http://127.0.0.1:{run.port}/", timeout=10) as home:  # the dashboard's sign-in
        assert home.url.endswith("/login/?next=/dashboard/") and b"Sign in" in home.read()
    job = run.submit()
    assert job["status"] == "queued"
    finished = call(f"{run.base}/jobs/{job['id']}/wait/?timeout=30", run.token)
    assert finished["status"] == "done" and finished["result"]["simulated"] is True
    assert finished["result"]["message"]["content"].endswith("Hello")
    # The README's three lines: the demo's sim model through the OpenAI SDK, plain, streamed, embedded.
    client = OpenAI(base_url=f"http://127.0.0.1:{run.port}/v1", api_key=run.token, max_retries=0, timeout=40)
    reply = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hello"}])
    assert reply.choices[0].message.content.endswith("Hello") and reply.usage.total_tokens > 0
    streamed = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).endswith("Hi")
    assert len(client.embeddings.create(model="sim", input="Hello").data[0].embedding) == 8

    run.ctrl_c()
    assert run.proc.wait(timeout=60) == 0, run.log_path.read_text()
    assert not answers(f"{run.base}/schema/")


def test_one_ctrl_c_finishes_the_job_in_flight_while_the_api_answers(run):
    # Given a job that takes 6 s, in flight...
    run.slow_sim(6000)
    run.start()
    pids = children(run.proc.pid)
    job = run.submit()
    wait_until(lambda: run.job(job["id"])["status"] == "running", timeout=30, what="the job to start")

    # When Ctrl-C is pressed once...
    run.ctrl_c()
    time.sleep(1)

    # Then the API still answers while the job runs on...
    assert run.proc.poll() is None
    assert run.job(job["id"])["status"] == "running"
    # ...the job finishes, and then both processes are gone with bin/run.
    assert run.proc.wait(timeout=60) == 0, run.log_path.read_text()
    assert run.job_status_in_database(job["id"]) == "done"
    assert not any(running(pid) for pid in pids), run.log_path.read_text()
    assert not answers(f"{run.base}/schema/")


def test_two_ctrl_c_give_the_job_back_and_leave_nothing_running(run):
    # Given a job that would take a minute, in flight...
    run.slow_sim(60_000)
    run.start()
    pids = children(run.proc.pid)
    job = run.submit()
    wait_until(lambda: run.job(job["id"])["status"] == "running", timeout=30, what="the job to start")

    # When Ctrl-C is pressed twice...
    run.ctrl_c()
    wait_until(lambda: "stopping" in run.log_path.read_text(), timeout=10, what="the first Ctrl-C to be heard")
    run.ctrl_c()

    # Then bin/run returns promptly, with the job back in the queue and no process left behind.
    started = time.monotonic()
    assert run.proc.wait(timeout=40) == 0, run.log_path.read_text()
    assert time.monotonic() - started < 30
    assert not any(running(pid) for pid in pids), run.log_path.read_text()
    assert run.job_status_in_database(job["id"]) == "queued"


def test_the_grace_is_bounded(tmp_path):
    # Given a grace of 3 s and a job that would take a minute...
    run = Run(tmp_path, TELEMACHUS_SHUTDOWN_GRACE="3")
    try:
        run.slow_sim(60_000)
        run.start()
        job = run.submit()
        wait_until(lambda: run.job(job["id"])["status"] == "running", timeout=30, what="the job to start")

        # When Ctrl-C is pressed once...
        run.ctrl_c()
        time.sleep(1)
        assert run.job(job["id"])["status"] == "running", "the API is up during the grace"

        # Then after the grace the job goes back to the queue and everything stops.
        assert run.proc.wait(timeout=40) == 0, run.log_path.read_text()
        assert run.job_status_in_database(job["id"]) == "queued"
    finally:
        run.stop_all()


def test_ctrl_c_works_even_when_started_with_sigint_ignored(run):
    run.start(sigint_ignored=True)
    pids = children(run.proc.pid)
    run.ctrl_c()
    assert run.proc.wait(timeout=60) == 0, run.log_path.read_text()
    assert not any(running(pid) for pid in pids)


def descendants(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *descendants(child)]
    return found


@pytest.mark.parametrize("pipe", ["| tee", "2>&1 | tee"])
def test_ctrl_c_through_a_pipe_to_tee_leaves_nothing_running(run, pipe):
    """`make run | tee log`: Ctrl-C reaches tee too, which dies, so the pipe breaks under bin/run and
    the processes it started. Whatever they write now meets a closed pipe (SIGPIPE, EPIPE): bin/run
    must still stop both of them before the prompt comes back."""
    log = open(run.log_path, "w")
    run.proc = subprocess.Popen(
        ["bash", "-c", f"bin/run {pipe} {run.tmp_path}/tee.log"],
        cwd=ROOT,
        env={**run.env, "PY": sys.executable, "PORT": str(run.port)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_until(lambda: answers(f"{run.base}/schema/"), timeout=60, what="daphne to listen")
    wait_until(lambda: len(descendants(run.proc.pid)) >= 4, timeout=30, what="bin/run, tee, daphne and the worker")
    pids = descendants(run.proc.pid)

    run.ctrl_c()
    run.proc.wait(timeout=60)
    time.sleep(0.5)
    left = [pid for pid in pids if running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, (run.log_path.read_text(), (run.tmp_path / "tee.log").read_text())
    assert not answers(f"{run.base}/schema/")
