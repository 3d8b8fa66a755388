"""Arize Phoenix as the tests' OTLP receiver: a real one, started on loopback ports of its own, and
read back through its REST API. Use the `phoenix` fixture (a module of tests imports it: `from
tests.phoenix import phoenix`), point a process at `phoenix.endpoint` with OTEL_EXPORTER_OTLP_ENDPOINT
and wait for its spans with `phoenix.spans(trace_id, ...)`."""

import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.processes import ROOT, free_port, wait_until

PHOENIX = ROOT / "var/phoenix/venv/bin/phoenix"


class Phoenix:
    def __init__(self, base: str) -> None:
        self.base = base
        # OTLP/HTTP: the exporter adds /v1/traces.
        self.endpoint = base

    def spans(self, trace_id: str) -> list[dict]:
        """The spans Phoenix holds of one trace (REST: /v1/projects/default/spans?trace_id=...)."""
        answer = httpx.get(
            f"{self.base}/v1/projects/default/spans", params={"trace_id": trace_id, "limit": 1000}, timeout=10
        )
        answer.raise_for_status()
        return answer.json()["data"]

    def wait_for(self, trace_id: str, *, count: int = 1, timeout: float = 30) -> list[dict]:
        return wait_until(
            lambda: spans if len(spans := self.spans(trace_id)) >= count else None,
            timeout=timeout,
            interval=0.2,
            what=f"{count} span(s) of trace {trace_id} in Phoenix",
        )


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def phoenix(tmp_path_factory) -> Phoenix:
    """One Phoenix for the session (it takes about 10 s to start), on two free loopback ports,
    keeping its data in a temporary directory; stopped (by its process id) when the session ends.
    Skipped, saying how to install it, where bin/phoenix-test has not run (.ci/run runs it)."""
    if not PHOENIX.exists():
        pytest.skip("Arize Phoenix is not installed: run bin/phoenix-test (about a minute; .ci/run does)")
    work: Path = tmp_path_factory.mktemp("phoenix")
    port = free_port()
    env = {
        **os.environ,
        "PHOENIX_HOST": "127.0.0.1",
        "PHOENIX_PORT": str(port),
        "PHOENIX_GRPC_PORT": str(free_port()),
        "PHOENIX_WORKING_DIR": str(work),
        "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    for name in [name for name in env if name.startswith("OTEL_") or name == "DATABASE_URL"]:
        del env[name]
    with open(work / "phoenix.log", "w") as log:
        proc = subprocess.Popen([str(PHOENIX), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _healthy(base), timeout=120, interval=0.2, what="Phoenix")
        if proc.poll() is not None:
            raise AssertionError(f"Phoenix exited: {(work / 'phoenix.log').read_text()[-2000:]}")
        yield Phoenix(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
