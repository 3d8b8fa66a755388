"""DATABASE_URL through a transaction-pooling PgBouncer (bin/pgbouncer-test) without
TELEMACHUS_PGBOUNCER used to start, then fail about every other request (`prepared statement ...
does not exist`) while the worker looped on `unsupported startup parameter: options` and /readyz
said ok. Now the API server, the worker and `make run`'s first step refuse it in one line that
names TELEMACHUS_PGBOUNCER and TELEMACHUS_LISTEN_DATABASE_URL, and /readyz of a process that got
past them (served by uvicorn directly) answers 503. Real processes against a real PgBouncer:
127.0.0.1:6432 (bin/pgbouncer-test), or DATABASE_URL's own when the suite runs through one
(.ci/run's PgBouncer step, TELEMACHUS_PGBOUNCER=1)."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import dj_database_url
import psycopg
import pytest
from django.conf import settings
from django.db import connection

from tests.processes import ROOT, Processes, answers, free_port, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

EX_CONFIG = 78
BIN_PGBOUNCER_TEST = ("127.0.0.1", 6432)


def addresses() -> tuple[tuple[str, int], tuple[str, int]]:
    """(the pooler, PostgreSQL itself) as this test run reaches them."""
    s = connection.settings_dict
    here = (s.get("HOST") or "127.0.0.1", int(s.get("PORT") or 5432))
    if settings.TELEMACHUS_PGBOUNCER:
        listen = dj_database_url.parse(settings.TELEMACHUS_LISTEN_DATABASE_URL)
        return here, (listen["HOST"] or "127.0.0.1", int(listen["PORT"] or 5432))
    return BIN_PGBOUNCER_TEST, here


def url(address: tuple[str, int]) -> str:
    s = connection.settings_dict
    password = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    return f"postgres://{s.get('USER') or 'postgres'}{password}@{address[0]}:{address[1]}/{s['NAME']}"


@pytest.fixture
def pooler():
    """The pooler's and PostgreSQL's URLs for the test database; skips without a PgBouncer."""
    pooled, direct = addresses()
    try:
        with psycopg.connect(url(pooled), connect_timeout=2, autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
            if row[0] == conn.info.backend_pid:
                pytest.skip(f"{pooled[0]}:{pooled[1]} is not a pooler")
    except psycopg.OperationalError:
        pytest.skip("needs PgBouncer in transaction pooling on 127.0.0.1:6432 (bin/pgbouncer-test)")
    yield url(pooled), url(direct)
    if not settings.TELEMACHUS_PGBOUNCER:
        # The pooler keeps idle server connections to the test database, which would stop
        # pytest-django from dropping it: closed here (bin/pgbouncer-test's `drop` does the same).
        # Not when the suite itself runs through the pooler: .ci/run keeps that database.
        with psycopg.connect(url(pooled).rsplit("/", 1)[0] + "/pgbouncer", autocommit=True) as admin:
            name = connection.settings_dict["NAME"]
            admin.execute(f'KILL "{name}"', prepare=False)
            admin.execute(f'RESUME "{name}"', prepare=False)


def environment(processes: Processes, database_url: str, **env: str) -> dict[str, str]:
    # Empty values unset what the suite's own environment may set (behind its PgBouncer).
    unset = {"TELEMACHUS_PGBOUNCER": "", "TELEMACHUS_LISTEN_DATABASE_URL": ""}
    return processes.env(**{**unset, "DATABASE_URL": database_url, **env})


def refusal(argv: list[str], env: dict[str, str], program: str) -> str:
    started = time.monotonic()
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == EX_CONFIG, done.stdout + done.stderr
    assert time.monotonic() - started < 30
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: configuration error: "), done.stderr
    return lines[0]


def test_the_api_server_refuses_a_pooler_it_was_not_told_of(processes, pooler):
    pooled, direct = pooler
    port = free_port()
    line = refusal(
        ["-m", "telemachus.serve", "127.0.0.1", str(port)], environment(processes, pooled), "telemachus.serve"
    )
    assert "reaches PostgreSQL through a connection pooler" in line
    # The fix, with PostgreSQL's own address as it reported it.
    host_port = direct.split("@")[1].split("/")[0]
    assert "set TELEMACHUS_PGBOUNCER=1 and TELEMACHUS_LISTEN_DATABASE_URL=" in line
    assert f"@{host_port}/{connection.settings_dict['NAME']}" in line, line
    assert not answers(f"http://127.0.0.1:{port}/healthz")


def test_the_worker_refuses_it_before_its_loop_would_retry_the_refused_options_forever(processes, pooler):
    pooled, _ = pooler
    line = refusal(["manage.py", "scheduler_worker"], environment(processes, pooled), "manage.py")
    assert "unsupported startup parameter: options" in line  # what PgBouncer said to the worker's connect
    assert "set TELEMACHUS_PGBOUNCER=1 and TELEMACHUS_LISTEN_DATABASE_URL=" in line


def test_a_worker_that_sends_no_session_setting_is_refused_by_the_pid_comparison(processes, pooler):
    pooled, _ = pooler
    env = environment(processes, pooled, TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS="0")
    line = refusal(["manage.py", "scheduler_worker"], env, "manage.py")
    assert (
        "reaches PostgreSQL through a connection pooler (PgBouncer or similar) but TELEMACHUS_PGBOUNCER is off" in line
    )
    assert "unsupported startup parameter" not in line


def test_make_runs_first_step_stops_before_migrate_would_run_through_it(processes, pooler):
    pooled, _ = pooler
    line = refusal(["manage.py", "database_ensure"], environment(processes, pooled), "manage.py")
    assert "TELEMACHUS_PGBOUNCER" in line


def test_with_the_setting_but_listen_through_the_pooler_too_it_refuses_naming_the_listen_url(processes, pooler):
    pooled, _ = pooler
    env = environment(processes, pooled, TELEMACHUS_PGBOUNCER="1")
    line = refusal(["manage.py", "scheduler_worker"], env, "manage.py")
    assert "TELEMACHUS_PGBOUNCER=1 but TELEMACHUS_LISTEN_DATABASE_URL is not set" in line
    env = environment(processes, pooled, TELEMACHUS_PGBOUNCER="1")
    env["TELEMACHUS_LISTEN_DATABASE_URL"] = pooled
    line = refusal(["-m", "telemachus.serve", "127.0.0.1", str(free_port())], env, "telemachus.serve")
    assert "TELEMACHUS_LISTEN_DATABASE_URL reaches a connection pooler too" in line


def test_set_up_as_documented_it_serves_and_says_how_it_reaches_the_database(processes, pooler):
    pooled, direct = pooler
    env = environment(processes, pooled, TELEMACHUS_PGBOUNCER="1")
    env["TELEMACHUS_LISTEN_DATABASE_URL"] = direct
    port = free_port()
    server = processes.spawn("api", "-m", "telemachus.serve", "127.0.0.1", str(port), **env)
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/readyz"), timeout=60, what="the API to be ready")
    banner = server.log_path.read_text()
    assert "through a connection pooler (TELEMACHUS_PGBOUNCER=1), LISTEN straight to PostgreSQL at" in banner
    assert "warning" not in banner


def test_the_setting_without_a_pooler_is_harmless_and_the_banner_says_so(processes, pooler):
    _, direct = pooler
    env = environment(processes, direct, TELEMACHUS_PGBOUNCER="1")
    port = free_port()
    server = processes.spawn("api", "-m", "telemachus.serve", "127.0.0.1", str(port), **env)
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/readyz"), timeout=60, what="the API to be ready")
    assert (
        "warning   TELEMACHUS_PGBOUNCER=1 but DATABASE_URL reaches PostgreSQL directly: harmless"
        in server.log_path.read_text()
    )


def test_readyz_is_not_ok_for_a_process_served_past_the_start_up_check(processes, pooler):
    """uvicorn started by hand on the app, not through telemachus/serve.py: nothing refused it."""
    pooled, _ = pooler
    port = free_port()
    env = environment(processes, pooled)
    processes.spawn(
        "uvicorn", "-m", "uvicorn", "--port", str(port), "--lifespan", "off", "telemachus.asgi:application", **env
    )
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="uvicorn to listen")
    for _ in range(8):  # past psycopg's prepare threshold (5), where a prepared ping would break instead
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10)
        assert answer.value.code == 503
        body = json.loads(answer.value.read())
        assert body["status"] == "unavailable"
        assert "connection pooler but TELEMACHUS_PGBOUNCER is off" in body["checks"]["database"], body


def test_telemachus_check_reports_it_as_a_problem(processes, pooler):
    pooled, _ = pooler
    done = subprocess.run(
        [sys.executable, "manage.py", "telemachus_check", "--checks-only"],
        cwd=ROOT,
        env=environment(processes, pooled),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    problem = next(line for line in done.stdout.splitlines() if " database " in line)
    assert "PROBLEM" in problem and "TELEMACHUS_PGBOUNCER is off" in problem
