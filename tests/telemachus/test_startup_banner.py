"""The API server and the worker say, as they start, which database they serve (engine, user,
host, port, name: never the password), the server, Redis or none, and where the metrics go: a
second terminal without the right DATABASE_URL shows it in its first lines, not as a bare 401 later.
A database that does not answer yet does not stop them: they say so, and /readyz answers 503."""

import json
import urllib.error
import urllib.request

import pytest

from tests.processes import answers, free_port, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def banner(log_path) -> list[str]:
    """The banner's lines in a process's log: from its first line to the last indented one."""
    lines = log_path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Telemachus "))
    end = start + 1
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    return lines[start:end]


def test_the_api_server_names_database_server_redis_and_metrics(processes, tmp_path):
    port = free_port()
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    server = processes.spawn(
        "api", "-m", "telemachus.serve", "127.0.0.1", str(port), PROMETHEUS_MULTIPROC_DIR=str(metrics), REDIS_URL=""
    )
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="the API to listen")
    lines = banner(server.log_path)
    assert lines[0] == f"Telemachus API on http://127.0.0.1:{port}/, served by uvicorn (DEBUG on)"
    database = processes.env()["DATABASE_URL"]
    assert lines[1].startswith("  database  ")
    assert (database.split("/", 3)[3] if database.startswith("sqlite") else database.rsplit("/", 1)[1]) in lines[1]
    assert (
        lines[2]
        == "  redis     none: in-memory channel layer, throttle and sign-in counts per process (one API process only)"
    )
    assert lines[3].startswith(f"  metrics   {metrics} (PROMETHEUS_MULTIPROC_DIR")


def test_daphne_is_named_when_it_serves(processes):
    port = free_port()
    server = processes.spawn("api", "-m", "telemachus.serve", "127.0.0.1", str(port), TELEMACHUS_SERVER="daphne")
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="daphne to listen")
    assert banner(server.log_path)[0].endswith("served by daphne (DEBUG on)")


def test_a_database_that_does_not_answer_is_named_without_its_password_and_not_ready(processes):
    # Given a PostgreSQL URL, with a password, where nothing listens...
    nowhere = f"postgres://app:s3cret-pw@127.0.0.1:{free_port()}/telemachus"
    port = free_port()

    # When the API server and a worker start on it...
    server = processes.spawn("api", "-m", "telemachus.serve", "127.0.0.1", str(port), DATABASE_URL=nowhere)
    worker = processes.start("worker", "scheduler_worker", "--name", "w1", DATABASE_URL=nowhere, REDIS_URL="")
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="the API to listen")
    wait_until(lambda: "Telemachus worker" in worker.log_path.read_text(), timeout=60, what="the worker's banner")

    # Then both name it, without the password, and start anyway; the API is not ready.
    for log in (server.log_path, worker.log_path):
        lines = banner(log)
        assert lines[1].startswith("  database  postgresql app@127.0.0.1:"), lines
        assert "/telemachus, not answering yet" in lines[1]
        assert "the database does not answer yet: starting anyway" in lines[-1]
        assert "s3cret-pw" not in log.read_text()
    assert banner(worker.log_path)[0] == "Telemachus worker w1 (DEBUG on)"
    assert worker.poll() is None, "the worker waits for its database, as it always has"
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=20)
    assert answer.value.code == 503
    assert json.loads(answer.value.read())["checks"]["database"].startswith("unreachable")
