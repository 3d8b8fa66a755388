"""Real processes for tests: worker processes (`manage.py scheduler_worker`), model servers
(`manage.py simllm`, the fault server), the ASGI app under the server bin/run starts
(telemachus/serve.py: TELEMACHUS_SERVER, uvicorn by default), all on 127.0.0.1, against the test
database."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from django.db import connection

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], *, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def database_url_for_tests() -> str:
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    user = s.get("USER") or "postgres"
    password = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    return f"postgres://{user}{password}@{s.get('HOST') or '127.0.0.1'}:{s.get('PORT') or 5432}/{s['NAME']}"


class Processes:
    """Starts processes for one test and makes sure none outlives it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": database_url_for_tests(),
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def start(self, name: str, *args: str, **env: str) -> subprocess.Popen:
        """`manage.py <args>` in a process of its own, output to <tmp>/<name>.log."""
        return self.spawn(name, "manage.py", *args, **env)

    def spawn(self, name: str, *argv: str, **env: str) -> subprocess.Popen:
        log = open(self.tmp_path / f"{name}.log", "w")
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=self.env(**env), stdout=log, stderr=subprocess.STDOUT
        )
        proc.log_path = self.tmp_path / f"{name}.log"
        self.procs.append(proc)
        return proc

    def worker(
        self, name: str, *, concurrency: int = 16, lease: int = 30, extra: tuple[str, ...] = (), **env: str
    ) -> subprocess.Popen:
        return self.start(
            name,
            "scheduler_worker",
            "--name",
            name,
            "--concurrency",
            str(concurrency),
            *extra,
            TELEMACHUS_LEASE_SECONDS=str(lease),
            **env,
        )

    def faultserver(self, **env: str) -> str:
        """Start tests/executors/faultserver.py; returns its base URL once it answers."""
        port = free_port()
        self.spawn(f"faultserver-{port}", "-m", "tests.executors.faultserver", "--port", str(port), **env)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(base + "/ok/v1/models"), timeout=20, what="the fault server to listen")
        return base

    def simllm(self, *, latency_ms: float = 50, models: str = "m", **options: str) -> str:
        """Start simllm; returns its base URL once it answers."""
        port = free_port()
        args = ["simllm", "--port", str(port), "--latency-ms", str(latency_ms), "--models", models]
        for key, value in options.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        self.start(f"simllm-{port}", *args)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(base + "/v1/models"), timeout=20, what="simllm to listen")
        return base

    def api_server(self, name: str = "api", **env: str) -> str:
        """Serve the ASGI app (telemachus.asgi) as bin/run does (telemachus/serve.py: uvicorn, or the
        server TELEMACHUS_SERVER names); returns its base URL once it answers."""
        port = free_port()
        self.spawn(f"{name}-{port}", "-m", "telemachus.serve", "127.0.0.1", str(port), **env)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: responds(base + "/v1/models"), timeout=60, what="the API server to listen")
        return base

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=10)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


def responds(url: str) -> bool:
    """Any HTTP answer, an error status included."""
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def http_json(url: str, method: str = "GET") -> dict:
    request = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())
