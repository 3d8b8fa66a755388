import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "telemachus.settings", **env},
        timeout=120,
    )


def test_deploy_check_is_clean_with_production_values(tmp_path):
    result = manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        DEBUG="0",
        SECRET_KEY="k" * 64 + "-Zq9",
        ALLOWED_HOSTS="sched.example.com",
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_debug_off_without_secret_key_refuses_to_start(tmp_path):
    result = manage("check", DEBUG="0", SECRET_KEY="", DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}")
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr


def test_bad_boolean_is_a_clear_error(tmp_path):
    result = manage("check", DEBUG="maybe", DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}")
    assert result.returncode != 0
    assert "DEBUG must be a boolean" in result.stderr
