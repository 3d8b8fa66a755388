"""A setting that cannot be used stops manage.py and the server with one line on stderr that names
it and the fix, and exit status 78 (EX_CONFIG), never a traceback (it used to start with a
misleading `KeyError: 'database_ensure'`). A DATABASE_URL that is misspelt, unparsable or missing
in production is refused rather than served from an empty SQLite file. Each from a fresh process
with the real settings, as a deployer starts one."""

import os
import subprocess
import sys

import pytest

from tests.processes import ROOT, free_port

EX_CONFIG = 78


def run(argv: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TELEMACHUS_", "DATABASE_", "REDIS_", "SECRET_", "DEBUG", "ALLOWED_"))
    }
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, "DJANGO_SETTINGS_MODULE": "telemachus.settings", "TELEMACHUS_VAR_DIR": str(tmp_path), **env},
    )


def refused(done: subprocess.CompletedProcess, program: str = "manage.py") -> str:
    """The one line a refusal prints, after checking that it is all it printed."""
    assert done.returncode == EX_CONFIG, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{program}: configuration error: "), lines[0]
    assert "Traceback" not in done.stderr and "KeyError" not in done.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["database_ensure", "check", "scheduler_worker", "telemachus_check"])
def test_debug_off_without_secret_key_is_one_line_for_every_command(tmp_path, command):
    # The issue's `DEBUG=0 make run`: its first step is `manage.py database_ensure`, an app's
    # command, whose lookup Django's manage.py wrapped in a KeyError.
    line = refused(run(["manage.py", command], tmp_path, DEBUG="0"))
    assert "SECRET_KEY must be set when DEBUG is off" in line
    assert "secrets.token_urlsafe(50)" in line  # how to make one


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("TELEMACHUS_LEASE_SECONDS", "abc", "TELEMACHUS_LEASE_SECONDS must be a whole number of seconds"),
        ("TELEMACHUS_LEASE_SECONDS", "0", "TELEMACHUS_LEASE_SECONDS must be a whole number of seconds, at least 1"),
        ("TELEMACHUS_GATEWAY_TIMEOUT_SECONDS", "ten", "TELEMACHUS_GATEWAY_TIMEOUT_SECONDS must be a number"),
        ("TELEMACHUS_PGBOUNCER", "maybe", "TELEMACHUS_PGBOUNCER must be a boolean"),
        ("TELEMACHUS_SUBMIT_RATE", "100 per second", "TELEMACHUS_SUBMIT_RATE must be N/s, N/min"),
        ("TELEMACHUS_SERVER", "gunicorn", "TELEMACHUS_SERVER must be one of uvicorn, daphne"),
        ("LOG_LEVEL", "chatty", "LOG_LEVEL must be one of DEBUG, INFO"),
        ("REDIS_URL", "127.0.0.1:6379", "REDIS_URL must be redis://"),
        ("TELEMACHUS_LISTEN_DATABASE_URL", "127.0.0.1:5432", "TELEMACHUS_LISTEN_DATABASE_URL must be postgres://"),
    ],
)
def test_a_value_that_cannot_be_used_names_the_variable_and_the_fix(tmp_path, name, value, says):
    line = refused(run(["manage.py", "check"], tmp_path, **{name: value}))
    assert says in line and repr(value) in line, line
    assert "unset it" in line, line


def test_the_server_refuses_the_same_way_and_serves_nothing(tmp_path):
    port = free_port()
    done = run(["-m", "telemachus.serve", "127.0.0.1", str(port)], tmp_path, TELEMACHUS_LEASE_SECONDS="abc")
    assert "TELEMACHUS_LEASE_SECONDS must be a whole number" in refused(done, "telemachus.serve")


@pytest.mark.parametrize("misspelt", ["DATABSE_URL", "DATABASE_URI", "database_url"])
def test_a_misspelt_database_url_is_refused_not_served_from_sqlite(tmp_path, misspelt):
    line = refused(run(["manage.py", "check"], tmp_path, **{misspelt: "postgres://app:s3cret@db.internal/app"}))
    assert f"{misspelt} is set but DATABASE_URL is not: a misspelling?" in line
    assert "s3cret" not in line
    assert not (tmp_path / "telemachus.sqlite3").exists()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgres//app:s3cret@db/app", "DATABASE_URL is not a database URL (unknown scheme"),
        (
            "postgres://app:s3cret@db:54x2/app",
            "DATABASE_URL is not a database URL (not a valid URL: postgres://app:***@",
        ),
        ("mysql://app:s3cret@db/app", "DATABASE_URL names a mysql database"),
        ("postgres://app:s3cret@db:5432/", "DATABASE_URL names no database"),
        ("sqlite://", "DATABASE_URL names an in-memory SQLite database"),
    ],
)
def test_an_unusable_database_url_says_what_it_must_be_and_never_shows_the_password(tmp_path, url, says):
    line = refused(run(["manage.py", "check"], tmp_path, DATABASE_URL=url))
    assert says in line, line
    assert "postgres://USER:PASSWORD@HOST:5432/NAME" in line or "sqlite:////absolute/path" in line
    assert "s3cret" not in line


def test_production_without_database_url_is_refused_rather_than_run_on_sqlite(tmp_path):
    """DEBUG off and no DATABASE_URL: refused (docs/configuration.md says why); SQLite on purpose
    is one explicit URL away."""
    production = {"DEBUG": "0", "SECRET_KEY": "k" * 50 + "-Zq9x", "ALLOWED_HOSTS": "sched.example.com"}
    line = refused(run(["manage.py", "check"], tmp_path, **production))
    assert "DATABASE_URL is not set and DEBUG is off" in line
    assert not (tmp_path / "telemachus.sqlite3").exists()
    explicit = run(
        ["manage.py", "check"], tmp_path, DATABASE_URL=f"sqlite:///{tmp_path}/on-purpose.sqlite3", **production
    )
    assert explicit.returncode == 0, explicit.stderr


def test_a_lookalike_of_another_setting_is_a_warning_in_the_banner(tmp_path):
    # ALLOWED_HOST (for ALLOWED_HOSTS) leaves the default in force: said, not refused.
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TELEMACHUS_", "DATABASE_", "ALLOWED_"))}
    server = subprocess.Popen(
        [sys.executable, "-m", "telemachus.serve", "127.0.0.1", str(free_port())],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**environ, "DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite3", "ALLOWED_HOST": "sched.example.com"},
    )
    try:
        banner = [server.stdout.readline() for _ in range(5)]
    finally:
        server.kill()
        server.communicate(timeout=10)
    assert banner[0].startswith("Telemachus API on http://127.0.0.1:"), banner
    assert "warning   ALLOWED_HOST is set but ALLOWED_HOSTS is not: a misspelling of ALLOWED_HOSTS?" in banner[4]
