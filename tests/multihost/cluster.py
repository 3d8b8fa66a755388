"""A Telemachus deployment on the hosts of tests/multihost/netns.py, configured as docs/deploy.md
says: production settings (DEBUG off, a SECRET_KEY, ALLOWED_HOSTS, behind a TLS-terminating load
balancer), one PostgreSQL and one Redis on their own hosts, two API hosts (telemachus/serve.py, the
command bin/run serves with, after collectstatic), two worker hosts (`manage.py scheduler_worker`) and two
model servers (`manage.py simllm`), each host with its own var and metrics directories.

The test client plays the load balancer: it sends `X-Forwarded-Proto: https` and counts the
responses each API host sent, so the hosts' own counts (`/metrics`) can be checked against it."""

import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.db import connection

from tests.multihost.netns import Network, wait_listening

ROOT = Path(__file__).resolve().parents[2]
HOSTS = {
    "db": 2,
    "redis": 3,
    "api1": 11,
    "api2": 12,
    "worker1": 21,
    "worker2": 22,
    "llm1": 31,
    "llm2": 32,
    "client": 100,
}
API_HOSTS = ("api1", "api2")
WORKER_HOSTS = ("worker1", "worker2")
# Each worker host runs two calls at a time: an executor cap of 4 then binds only when several
# hosts claim at once, and a worker that frees a slot cannot keep the queue to itself.
WORKER_CONCURRENCY = 2
API_PORT, MODEL_PORT, WORKER_METRICS_PORT = 8000, 9100, 9101
LEASE_SECONDS = 4


@dataclass
class Response:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case


class Cluster:
    def __init__(self, workdir: Path, *, redis_upstream: str, redis_db: int) -> None:
        self.workdir = workdir
        self.net = Network(HOSTS, subnet="10.184.0", workdir=workdir)
        self.redis_upstream = redis_upstream
        self.redis_db = redis_db
        self.procs: dict[str, Any] = {}
        self.sent: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None

    # --- set-up -----------------------------------------------------------------------------------

    def env(self, host: str, *, metrics: bool = False, **extra: str) -> dict[str, str]:
        """What a host of this deployment is given (docs/deploy.md, "What each host needs"). With
        `metrics`, the host's own directory for the multiprocess metrics of its API or worker
        processes, made empty (files of dead processes would count); commands such as
        collectstatic and the model servers get none."""
        db = connection.settings_dict
        var = self.workdir / host
        var.mkdir(exist_ok=True)
        if metrics:
            (var / "prometheus").mkdir()
            extra = {"PROMETHEUS_MULTIPROC_DIR": str(var / "prometheus"), **extra}
        return {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "telemachus.settings",
            "DEBUG": "0",
            # Token digests are keyed by it: the test made the tokens under its own.
            "SECRET_KEY": settings.SECRET_KEY,
            "ALLOWED_HOSTS": ",".join(self.address(h) for h in API_HOSTS),
            "BEHIND_TLS_PROXY": "1",
            "DATABASE_URL": f"postgres://{db['USER'] or 'postgres'}@{self.address('db')}:5432/{db['NAME']}",
            "REDIS_URL": f"redis://{self.address('redis')}:6379/{self.redis_db}",
            "REDIS_PREFIX": self.net.tag,
            "TELEMACHUS_VAR_DIR": str(var),
            "TELEMACHUS_LEASE_SECONDS": str(LEASE_SECONDS),
            **extra,
        }

    def address(self, host: str) -> str:
        return self.net.address(host)

    def redis_group_exists(self, group: str) -> bool:
        """Whether the channel layer's group `group` has members, read from the Redis itself (as the
        test reads PostgreSQL: from the machine, not through the hosts)."""
        client = redis.Redis.from_url(f"redis://{self.redis_upstream}/{self.redis_db}")
        try:
            return bool(client.exists(f"{self.net.tag}:group:{group}"))
        finally:
            client.close()

    def manage(self, host: str, name: str, *args: str, metrics: bool = False, **extra: str) -> Any:
        env = self.env(host, metrics=metrics, **extra)
        return self.net.run(host, name, [sys.executable, "manage.py", *args], env, cwd=ROOT)

    def start(self, *, models: dict[str, dict[str, str]]) -> None:
        """Every host, each process started once the hosts it needs answer. `models`: per model
        host, its simllm options."""
        self.net.up()
        self.pool = ThreadPoolExecutor(max_workers=64, initializer=self.net.enter, initargs=("client",))
        db = connection.settings_dict
        self.net.forward("db", 5432, f"{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}")
        self.net.forward("redis", 6379, self.redis_upstream)
        for host, options in models.items():
            argv = ["simllm", "--host", self.address(host), "--port", str(MODEL_PORT)]
            for key, value in options.items():
                argv += [f"--{key}", value]
            self.procs[host] = self.manage(host, host, *argv)
        # Static files are each API host's own (WhiteNoise serves them from its STATIC_ROOT, read at start).
        static = [self.manage(h, f"{h}-collectstatic", "collectstatic", "--noinput") for h in API_HOSTS]
        for host, port in (("db", 5432), ("redis", 6379), *((h, MODEL_PORT) for h in models)):
            self.on_client(wait_listening, self.address(host), port, timeout=30, what=host)
        for host in WORKER_HOSTS:
            bind = f"{self.address(host)}:{WORKER_METRICS_PORT}"
            self.procs[host] = self.manage(
                host,
                host,
                "scheduler_worker",
                "--name",
                host,
                "--concurrency",
                str(WORKER_CONCURRENCY),
                metrics=True,
                TELEMACHUS_METRICS_BIND=bind,
            )
        for host, proc in zip(API_HOSTS, static, strict=True):
            assert proc.wait(timeout=60) == 0, f"collectstatic failed on {host}: see {proc.log_path}"
            argv = [sys.executable, "-m", "telemachus.serve", self.address(host), str(API_PORT)]
            self.procs[host] = self.net.run(host, host, argv, self.env(host, metrics=True), cwd=ROOT)
        for host in API_HOSTS:
            self.on_client(wait_listening, self.address(host), API_PORT, timeout=60, what=f"the API on {host}")
        for host in WORKER_HOSTS:
            self.on_client(wait_listening, self.address(host), WORKER_METRICS_PORT, timeout=60, what=host)

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.net.down()

    # --- the client host ------------------------------------------------------------------------

    def on_client(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn` in a thread of the client host and return what it returns."""
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        assert self.pool is not None
        return self.pool.submit(fn, *args, **kwargs)

    def request(
        self,
        host: str,
        method: str,
        path: str,
        *,
        token: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> Future:
        """An HTTP call from the client host, through the load balancer's eyes (it terminated TLS)."""
        port = API_PORT if host in API_HOSTS else WORKER_METRICS_PORT if host in WORKER_HOSTS else MODEL_PORT
        url = f"http://{self.address(host)}:{port}{path}"
        sent = {"X-Forwarded-Proto": "https", **(headers or {})}
        if token:
            sent["Authorization"] = f"Bearer {token}" if path.startswith("/v1/") else f"Token {token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"

        def call() -> Response:
            request = urllib.request.Request(url, data=data, method=method, headers=sent)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as answer:
                    status, raw, got = answer.status, answer.read(), answer.headers
            except urllib.error.HTTPError as error:
                status, raw, got = error.code, error.read(), error.headers
            if host in API_HOSTS:
                with self._lock:
                    self.sent[host] += 1
            headers = {name.lower(): value for name, value in got.items()}
            body = json.loads(raw) if "json" in headers.get("content-type", "") else raw.decode()
            return Response(status, body, headers)

        return self.submit(call)

    def stream(self, host: str, job_id: int, *, token: str, timeout: float = 60) -> Future:
        """Read the job's SSE stream on `host` to its end: [(time, event, data), ...]."""

        def read() -> list[tuple[float, str, Any]]:
            conn = http.client.HTTPConnection(self.address(host), API_PORT, timeout=timeout)
            conn.request(
                "GET",
                f"/api/jobs/{job_id}/stream/",
                headers={"Authorization": f"Token {token}", "X-Forwarded-Proto": "https"},
            )
            answer = conn.getresponse()
            with self._lock:
                self.sent[host] += 1
            assert answer.status == 200, (answer.status, answer.read())
            seen, event = [], None
            for raw in answer:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: "):
                    seen.append((time.time(), event, json.loads(line[len("data: ") :])))
                    if event == "done":
                        break
            conn.close()
            return seen

        return self.submit(read)

    def log_tails(self) -> str:
        tails = []
        for path in sorted(self.workdir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            tails.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(tails)
