"""What `make run` says before it serves, when it cannot or should not: a port another instance
holds (the second `make run` stops at once and leaves the first, and its metrics directory,
alone), and a PostgreSQL database that DATABASE_URL names but the server lacks (created when the
role may, else a stop within seconds with the exact createdb command). `make run` itself runs
here, with the interpreter of this test run (its install step skipped)."""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from django.db import connection
from psycopg import sql

from tests.processes import ROOT, answers, free_port, wait_until
from tests.test_make_run import Run, children, running

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent


def make_run(env: dict[str, str], port: int, **popen) -> subprocess.Popen:
    """`make run PORT=port`, as typed, but with this interpreter and without `pip install`."""
    return subprocess.Popen(
        ["make", "--no-print-directory", "-o", f"{VENV}/.installed-run", "run", f"VENV={VENV}", f"PY={sys.executable}"],
        cwd=ROOT,
        env={**env, "PORT": str(port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def finished(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """Exit status, output and seconds taken of a command expected to stop by itself."""
    started = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"still running after {timeout}s:\n{output}")
    return proc.returncode, output, time.monotonic() - started


def tree(pid: int) -> list[int]:
    found = []
    for child in children(pid):
        found += [child, *tree(child)]
    return found


def bin_run(env: dict[str, str]) -> tuple[int, str]:
    """bin/run expected to refuse: its exit status and output. Should it serve instead, what it
    started is killed (daphne and the worker run in process groups of their own)."""
    proc = subprocess.Popen(["bin/run"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        for pid in [*tree(proc.pid), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"bin/run served instead of refusing:\n{output}")
    return proc.returncode, output


def files(directory: Path) -> dict[str, int]:
    return {path.name: path.stat().st_ino for path in directory.iterdir()}


@pytest.fixture
def run(tmp_path):
    started = Run(tmp_path)
    # From here on, bin/run's default directory, as `make run` has it (Run's set-up commands kept
    # theirs in tmp_path: prometheus_client writes wherever the variable points, even "").
    del started.env["PROMETHEUS_MULTIPROC_DIR"]
    metrics = ROOT / "var/prometheus" / str(started.port)  # bin/run's default, one per port
    yield started
    started.stop_all()
    shutil.rmtree(metrics, ignore_errors=True)
    metrics.with_name(f"{metrics.name}.lock").unlink(missing_ok=True)


def test_a_second_make_run_on_the_port_in_use_stops_at_once_and_leaves_the_first_alone(run):
    # Given a running instance, with its metrics directory in use...
    run.start()
    pids = children(run.proc.pid)
    metrics = ROOT / "var/prometheus" / str(run.port)
    job = run.submit()
    wait_until(lambda: run.job(job["id"])["status"] == "done", timeout=30, what="a job, for the metrics files")
    wait_until(lambda: len(files(metrics)) >= 2, timeout=10, what="the processes' metrics files")
    before = files(metrics)

    # When `make run` is started again on the same port...
    rc, output, took = finished(make_run(run.env, run.port), timeout=60)

    # Then it stops at once, saying why and what to do...
    assert rc != 0, output
    assert took < 10, output
    assert f"cannot serve on 127.0.0.1:{run.port}" in output and "in use" in output, output
    assert f"make run PORT={run.port + 1}" in output, output
    assert "migrate" not in output, "it stopped before touching the database"
    # ...and the first instance serves on, its processes and its metrics files untouched.
    assert answers(f"{run.base}/schema/")
    assert children(run.proc.pid) == pids and all(running(pid) for pid in pids)
    assert files(metrics).items() >= before.items()
    # bin/run itself, started by hand, stops the same way.
    rc, output = bin_run({**run.env, "PY": sys.executable, "PORT": str(run.port)})
    assert rc == 1 and f"cannot serve on 127.0.0.1:{run.port}" in output, output
    assert files(metrics).items() >= before.items() and answers(f"{run.base}/schema/")


def test_a_second_instance_on_another_port_does_not_take_a_metrics_directory_in_use(tmp_path):
    # Given an instance whose processes write to a metrics directory named by hand...
    shared = tmp_path / "metrics"
    shared.mkdir()
    run = Run(tmp_path, PROMETHEUS_MULTIPROC_DIR=str(shared))
    try:
        run.start()
        wait_until(lambda: list(shared.iterdir()), timeout=10, what="the processes' metrics files")
        before = files(shared)

        # When another instance, on a free port, is pointed at the same directory...
        rc, output = bin_run({**run.env, "PY": sys.executable, "PORT": str(free_port())})

        # Then it refuses, and the first one's files are where they were.
        assert rc == 1 and "in use by another running instance" in output, output
        assert files(shared).items() >= before.items()
        assert answers(f"{run.base}/schema/")
    finally:
        run.stop_all()


# --- a PostgreSQL database that does not exist yet ------------------------------------------------


def server_url(user: str, name: str) -> str:
    s = connection.settings_dict
    password = f":{s['PASSWORD']}" if s.get("PASSWORD") and user == s.get("USER") else ""
    return f"postgres://{user}{password}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{name}"


def admin() -> psycopg.Connection:
    """A connection to the test server's maintenance database, as the suite's own role."""
    s = connection.settings_dict
    return psycopg.connect(
        dbname="postgres",
        user=s.get("USER") or "postgres",
        password=s.get("PASSWORD") or None,
        host=s.get("HOST") or "127.0.0.1",
        port=s.get("PORT") or 5432,
        autocommit=True,
    )


def database_exists(name: str) -> bool:
    with admin() as db:
        return db.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is not None


def environment(database_url: str) -> dict[str, str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "telemachus.settings",
        "PYTHONUNBUFFERED": "1",
        "DATABASE_URL": database_url,
    }
    for name in ("DEBUG", "REDIS_URL", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(name, None)
    return env


@pytest.fixture
def new_database_name():
    name = f"telemachus_makerun_{uuid.uuid4().hex[:8]}"
    yield name
    with admin() as db:
        db.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.mark.postgres
@pytest.mark.django_db
def test_make_run_creates_the_postgres_database_it_is_given(new_database_name):
    # Given a DATABASE_URL naming a database the server lacks, and a role that may create one...
    assert not database_exists(new_database_name)
    port = free_port()

    # When `make run`...
    proc = make_run(
        environment(server_url(connection.settings_dict.get("USER") or "postgres", new_database_name)), port
    )
    try:
        # Then it creates the database, migrates it, seeds the demo and serves.
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/api/schema/"), timeout=120, what="make run to serve")
        assert database_exists(new_database_name)
        pids = tree(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        wait_until(lambda: not any(running(pid) for pid in tree(proc.pid) + pids), timeout=60, what="a clean stop")
        shutil.rmtree(ROOT / "var/prometheus" / str(port), ignore_errors=True)
        (ROOT / "var/prometheus" / f"{port}.lock").unlink(missing_ok=True)
    assert f"created PostgreSQL database '{new_database_name}'" in output, output


@pytest.fixture
def role_without_createdb():
    name = f"telemachus_nocreate_{uuid.uuid4().hex[:8]}"
    with admin() as db:
        try:
            db.execute(sql.SQL("CREATE ROLE {} LOGIN NOCREATEDB").format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the suite's PostgreSQL role may not create roles")
    yield name
    with admin() as db:
        db.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.mark.postgres
@pytest.mark.django_db
def test_make_run_without_the_right_to_create_it_stops_with_the_createdb_command(
    new_database_name, role_without_createdb
):
    # Given a DATABASE_URL naming a missing database, for a role that may not create databases...
    port = free_port()
    s = connection.settings_dict

    # When `make run`...
    rc, output, took = finished(make_run(environment(server_url(role_without_createdb, new_database_name)), port), 60)
    (ROOT / "var/prometheus" / f"{port}.lock").unlink(missing_ok=True)  # its --check's

    # Then it stops within seconds with the exact command to run, and serves nothing.
    assert rc != 0 and took < 30, output
    command = (
        f"createdb -h {s.get('HOST') or '127.0.0.1'} -p {s.get('PORT') or 5432} -U postgres "
        f"-O {role_without_createdb} {new_database_name}"
    )
    assert command in output, output
    assert "permission denied to create database" in output
    assert "Traceback" not in output
    assert not answers(f"http://127.0.0.1:{port}/api/schema/")
    assert not database_exists(new_database_name)


def test_an_unreachable_postgres_stops_the_set_up_within_seconds_saying_what_to_check():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "manage.py", "database_ensure"],
        cwd=ROOT,
        env=environment(f"postgres://alice@127.0.0.1:{port}/telemachus"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and time.monotonic() - started < 20, done.stderr
    assert f"pg_isready -h 127.0.0.1 -p {port}" in done.stderr
    assert f"createdb -h 127.0.0.1 -p {port} -U postgres -O alice telemachus" in done.stderr
    assert "Traceback" not in done.stderr


# --- configuration errors ---------------------------------------------------------------------


def test_debug_off_without_a_secret_key_stops_make_run_with_one_line(tmp_path):
    """The issue's `DEBUG=0 make run`: it used to end in a 40-line traceback that began with
    `KeyError: 'database_ensure'`."""
    env = {**environment(f"sqlite:///{tmp_path}/db.sqlite3"), "DEBUG": "0", "TELEMACHUS_VAR_DIR": str(tmp_path)}
    env.pop("SECRET_KEY", None)
    port = free_port()
    rc, output, took = finished(make_run(env, port), timeout=60)
    (ROOT / "var/prometheus" / f"{port}.lock").unlink(missing_ok=True)  # its --check's
    assert rc != 0 and took < 30, output
    errors = [line for line in output.splitlines() if "configuration error" in line]
    assert errors == [
        "manage.py: configuration error: SECRET_KEY must be set when DEBUG is off: generate one with "
        "`python3 -c 'import secrets; print(secrets.token_urlsafe(50))'` and give every API and worker host the "
        "same, or set DEBUG=1 for a development run"
    ], output
    assert "Traceback" not in output and "KeyError" not in output
    assert "manage.py migrate" not in output, "it stopped at its first step"


def test_bin_run_exits_with_the_status_of_a_process_that_refused_to_start(tmp_path):
    env = {
        **environment(f"sqlite:///{tmp_path}/db.sqlite3"),
        "TELEMACHUS_LEASE_SECONDS": "abc",
        "PY": sys.executable,
        "PORT": str(free_port()),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics"),
    }
    rc, output = bin_run(env)
    assert rc == 78, output
    assert "configuration error: TELEMACHUS_LEASE_SECONDS must be a whole number of seconds" in output
    assert "Traceback" not in output
