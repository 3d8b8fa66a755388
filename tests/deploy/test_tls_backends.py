"""TLS from the app to PostgreSQL and to Redis, configured as docs/deploy.md says (`sslmode=verify-full`
and `sslrootcert` in DATABASE_URL; a `rediss://` REDIS_URL with `ssl_ca_certs`), against servers
that accept nothing else: a PostgreSQL cluster of the test's own whose pg_hba.conf admits TCP
clients only over TLS (`hostssl`), and a redis-server with a TLS port and no plain one, both with a
certificate signed by an authority the test makes with openssl.

Real processes with production settings (telemachus.settings): migrate, the demo's seed and a
token from manage.py, an API server and a worker. A job submitted through the API is run by the
worker against a model server that writes slowly, its output relayed to the API's event stream
through Redis, and it finishes; meanwhile pg_stat_ssl shows every one of their connections
encrypted. A client that does not use TLS, or that trusts another authority, is turned away.

Marked `postgres`: it runs in the suite's PostgreSQL run (it starts its own cluster and Redis, and
touches neither the test database nor the machine's Redis)."""

import json
import secrets
import subprocess
import sys
import time

import httpx
import psycopg
import pytest
import redis as redis_py

from tests.deploy.certs import certificates_make
from tests.deploy.servers import postgres_start, redis_client, redis_tls_start
from tests.processes import ROOT, Processes

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def tls_backends(tmp_path):
    certs = certificates_make(tmp_path / "tls")
    cluster = postgres_start(certs=certs)
    try:
        redis = redis_tls_start(certs=certs)
        try:
            yield certs, cluster, redis
        finally:
            redis.stop()
    finally:
        cluster.stop()


def test_a_job_runs_over_tls_to_postgresql_and_redis(tls_backends, tmp_path):
    certs, cluster, redis = tls_backends
    with cluster.connect(sslmode="verify-full", sslrootcert=str(certs.ca)) as admin:
        admin.execute("CREATE DATABASE telemachus")
    # Given the settings a host is given for encrypted, verified connections to both servers
    env = {
        "DJANGO_SETTINGS_MODULE": "telemachus.settings",
        "DATABASE_URL": cluster.url("telemachus", sslmode="verify-full", sslrootcert=str(certs.ca)),
        "REDIS_URL": f"rediss://127.0.0.1:{redis.port}/0?ssl_ca_certs={certs.ca}",
        "REDIS_PREFIX": f"tls-{secrets.token_hex(4)}",
        "TELEMACHUS_VAR_DIR": str(tmp_path / "var"),
    }
    processes = Processes(tmp_path)

    def manage(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=processes.env(**env), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    try:
        # When the database is migrated and seeded over TLS, and the API and a worker start
        manage("migrate", "--noinput")
        manage("telemachus_demo")
        token = manage("drf_create_token", "admin").split()[2]
        model = processes.simllm(latency_ms=50, models="slow", output_tokens=8, tokens_per_s=8)
        base = processes.api_server("api", **env)
        processes.worker("w1", concurrency=4, **env)
        headers = {"Authorization": f"Token {token}"}
        with httpx.Client(base_url=base, headers=headers, timeout=30) as client:
            executor = client.post(
                "/api/executors/",
                json={
                    "name": "writer",
                    "kind": "local-model",
                    "endpoint": f"{model}/v1",
                    "capabilities": {"models": ["slow"]},
                    "max_concurrency": 2,
                },
            )
            assert executor.status_code == 201, executor.text
            streamed = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": True}
            body = {"type": "chat", "team": "demo", "requirements": {"model": "slow"}, "input": streamed}
            submitted = client.post("/api/jobs/", json=body)
            assert submitted.status_code == 201, submitted.text
            job_id = submitted.json()["id"]

            # Then its output reaches the API's stream as the worker relays it (through Redis) ...
            deltas, done, event = [], None, None
            with client.stream("GET", f"/api/jobs/{job_id}/stream/") as stream:
                for line in stream.iter_lines():
                    if line.startswith("event: "):
                        event = line.removeprefix("event: ")
                    elif line.startswith("data: ") and event == "delta":
                        deltas.append(json.loads(line.removeprefix("data: "))["text"])
                    elif line.startswith("data: ") and event == "done":
                        done = json.loads(line.removeprefix("data: "))
                        break
            assert done is not None and done["status"] == "done", done
            assert len(deltas) > 1 and "".join(deltas) == done["result"]["message"]["content"], deltas

            # ... and every connection of the API server and the worker to PostgreSQL is encrypted
            with cluster.connect("telemachus", sslmode="verify-full", sslrootcert=str(certs.ca)) as watcher:
                rows = watcher.execute(
                    "SELECT s.ssl, s.version, a.application_name FROM pg_stat_activity a"
                    " JOIN pg_stat_ssl s USING (pid)"
                    " WHERE a.datname = 'telemachus' AND a.backend_type = 'client backend'"
                    " AND a.pid <> pg_backend_pid()"
                ).fetchall()
            # The worker's claim, finish and LISTEN connections; the API's pool and LISTEN connection.
            assert len(rows) >= 4, rows
            assert all(ssl and version.startswith("TLSv1.") for ssl, version, _ in rows), rows

            # And both reached Redis, over TLS: it has no other port
            clients = redis_client(redis.port, certs).client_list()
            assert len(clients) >= 3, clients  # this one, and the API's and the worker's

        # A client without TLS is refused by PostgreSQL, as is one that trusts another authority
        with pytest.raises(psycopg.OperationalError, match="no encryption"):
            cluster.connect("telemachus", sslmode="disable").close()
        stranger = certificates_make(tmp_path / "another-ca")
        with pytest.raises(psycopg.OperationalError, match="certificate verify failed"):
            cluster.connect("telemachus", sslmode="verify-full", sslrootcert=str(stranger.ca)).close()
        # Redis's port speaks TLS only, and its certificate is checked too
        plain = redis_py.Redis(host="127.0.0.1", port=redis.port, socket_connect_timeout=2, socket_timeout=2)
        with pytest.raises(redis_py.exceptions.ConnectionError):
            plain.ping()
        with pytest.raises(redis_py.exceptions.ConnectionError, match="certificate verify failed"):
            redis_client(redis.port, stranger).ping()
    finally:
        started = time.monotonic()
        processes.stop_all()
        assert time.monotonic() - started < 30
