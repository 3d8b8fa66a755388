"""`manage.py telemachus_check`: the configuration in force (each setting's value, secrets as
`(secret set)`, URLs without their password, and whether it came from the environment or is the
default), then checks that exit 1 on a problem. As a deployer runs it, from a fresh process, on
a production-like configuration (SQLite in a directory of the test's own: migrated and static
files collected once for the module)."""

import os
import re
import subprocess
import sys

import pytest

from tests.processes import ROOT, free_port

pytestmark = pytest.mark.slow

SECRET = "Zq9-" + "k7" * 30


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    var = tmp_path_factory.mktemp("var")
    env = {
        "DEBUG": "0",
        "SECRET_KEY": SECRET,
        "ALLOWED_HOSTS": "sched.example.com",
        "BEHIND_TLS_PROXY": "1",
        "TELEMACHUS_VAR_DIR": str(var),
        "DATABASE_URL": f"sqlite:///{var}/db.sqlite3",
        "TELEMACHUS_LEASE_SECONDS": "45",
    }
    for command in (["migrate", "--noinput"], ["collectstatic", "--noinput"]):
        assert check(env, *command).returncode == 0
    return env


def check(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TELEMACHUS_", "DATABASE_", "REDIS_", "SECRET_", "DEBUG", "ALLOWED_", "PROMETHEUS_"))
    }
    return subprocess.run(
        [sys.executable, "manage.py", *(argv or ["telemachus_check"])],
        cwd=ROOT,
        env={**environ, "DJANGO_SETTINGS_MODULE": "telemachus.settings", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def shown(output: str, name: str) -> tuple[str, str]:
    """A setting's (value, source) as the configuration listing shows it."""
    match = re.search(rf"^  {name} +(.*?)  \[(environment|default)\]$", output, re.MULTILINE)
    assert match, f"{name} not listed:\n{output}"
    return match.group(1), match.group(2)


def findings(output: str, level: str) -> dict[str, str]:
    found = {}
    for line in output.splitlines():
        match = re.match(rf"^  {level} +(\S+(?: \S+)?) {{2,}}(.*)$", line)
        if match:
            found.setdefault(match.group(1), match.group(2))
    return found


def test_a_production_configuration_is_listed_and_passes(production):
    done = check(production)
    assert done.returncode == 0, done.stdout + done.stderr
    assert shown(done.stdout, "SECRET_KEY") == ("(secret set)", "environment")
    assert SECRET not in done.stdout
    assert shown(done.stdout, "DEBUG") == ("0", "environment")
    assert shown(done.stdout, "TELEMACHUS_LEASE_SECONDS") == ("45", "environment")
    assert shown(done.stdout, "TELEMACHUS_GATEWAY_TIMEOUT_SECONDS") == ("600", "default")
    assert shown(done.stdout, "TELEMACHUS_PUBLIC_SCHEMA") == ("0", "default")
    ok = findings(done.stdout, "ok")
    assert ok["django"] == "check --deploy: no issues"
    assert set(ok) >= {"database", "migrations", "redis", "secret key", "allowed hosts", "tls", "static files"}
    assert done.stdout.rstrip().endswith("0 problems, 0 warnings")


def test_each_problem_is_named_and_the_exit_status_is_1(production):
    redis_port = free_port()  # nothing listens there
    done = check(
        {
            **production,
            "BEHIND_TLS_PROXY": "",
            "ALLOWED_HOSTS": "*",
            "REDIS_URL": f"redis://:r3dis-pw@127.0.0.1:{redis_port}/0",
            "TELEMACHUS_GATEWAY_TIMEOUT_SECOND": "10",
        }
    )
    assert done.returncode == 1, done.stdout + done.stderr
    problems = findings(done.stdout, "PROBLEM")
    assert problems["tls"].startswith("SECURE_SSL_REDIRECT is on but BEHIND_TLS_PROXY is off"), problems
    assert "ALLOWED_HOSTS has '*'" in problems["allowed hosts"]
    assert problems["redis"].startswith("REDIS_URL does not answer")
    assert problems["environment"] == (
        "TELEMACHUS_GATEWAY_TIMEOUT_SECOND is set but TELEMACHUS_GATEWAY_TIMEOUT_SECONDS is not: "
        "a misspelling of TELEMACHUS_GATEWAY_TIMEOUT_SECONDS?"
    )
    assert shown(done.stdout, "REDIS_URL") == (f"redis://:***@127.0.0.1:{redis_port}/0", "environment")
    assert "r3dis-pw" not in done.stdout + done.stderr


def test_an_unmigrated_database_and_uncollected_static_files_are_problems(production, tmp_path):
    done = check(
        {**production, "TELEMACHUS_VAR_DIR": str(tmp_path), "DATABASE_URL": f"sqlite:///{tmp_path}/new.sqlite3"}
    )
    assert done.returncode == 1
    problems = findings(done.stdout, "PROBLEM")
    assert problems["migrations"].endswith("run manage.py migrate")
    assert problems["static files"].endswith("run manage.py collectstatic --noinput")


def test_a_development_run_is_not_production(tmp_path):
    done = check({"TELEMACHUS_VAR_DIR": str(tmp_path)}, "telemachus_check", "--checks-only")
    assert done.returncode == 1
    problems = findings(done.stdout, "PROBLEM")
    assert problems["secret key"] == "SECRET_KEY is not set: the development key is in use (DEBUG on)"
    assert "security.W018" in done.stdout  # Django's own: DEBUG on
