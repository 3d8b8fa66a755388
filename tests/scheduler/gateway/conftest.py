"""A running stack for the gateway's tests, against the test database: the API server serving the ASGI app
and model servers, started once per module (they take seconds to start), and a worker per test.
Each test makes its own users, teams and executors; executors reach a model server under a path
prefix of their own, so the server's counters (GET /stats) are per test."""

import itertools
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlparse

import pytest
from django.contrib.auth.models import Permission
from django.db import connection

from executors.models import Executor
from telemachus.teams import rbac
from tests.credentials import token_for
from tests.processes import Processes, http_json

_prefixes = itertools.count(1)


@dataclass
class Stack:
    base: str  # the API, e.g. http://127.0.0.1:PORT
    simllm: str  # 30 ms to the first token, instant after
    slow: str  # 5 s to the first token
    trickle: str  # 50 ms to the first token, then 8 tokens a second
    faults: str
    processes: Processes

    def executor(self, server: str, **options) -> Executor:
        return model_executor(server, **options)

    @staticmethod
    def stats(executor: Executor) -> dict:
        """What the model server counted for this executor's prefix."""
        parsed = urlparse(executor.endpoint)
        prefix = parsed.path.removesuffix("/v1").strip("/")
        return http_json(f"{parsed.scheme}://{parsed.netloc}/stats")["prefixes"].get(prefix, {})


def model_executor(
    server: str, *, models=("m",), name: str | None = None, prefix: str | None = None, **fields
) -> Executor:
    """An executor on `server` under a fresh path prefix (the fault server's picks its fault)."""
    prefix = prefix or f"p{next(_prefixes)}"
    fields.setdefault("max_concurrency", 8)
    return Executor.objects.create(
        name=name or f"x{next(_prefixes)}",
        kind="local-model",
        endpoint=f"{server}/{prefix}/v1",
        capabilities={"models": list(models), **fields.pop("capabilities", {})},
        **fields,
    )


def may_chat(user):
    """Grant `chat:use` to the user directly. Team grants are guardian object permissions, which a
    long-lived server resolves through Django's per-process ContentType cache, and the flush
    between transactional tests recreates content types under new ids; a global grant does not
    depend on them. (Production's content types do not change under a running server.)"""
    user.user_permissions.add(Permission.objects.get(codename=rbac.PERMISSIONS[rbac.CHAT]))
    return user


def token(user) -> str:
    """A new API token of the user."""
    return token_for(user)


def redis_url() -> str | None:
    """The Redis of this machine, if one answers (tests that need it skip otherwise)."""
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=1):
            return url
    except OSError:
        return None


def live_deltas() -> bool:
    """Whether output deltas cross processes in the stack as started (PostgreSQL NOTIFY or Redis)."""
    return connection.vendor == "postgresql" or bool(os.environ.get("REDIS_URL"))


WORKER_ENV = {
    "TELEMACHUS_RETRY_BASE_SECONDS": "0.05",
    "TELEMACHUS_RETRY_MAX_SECONDS": "0.2",
    "TELEMACHUS_PROBE_INTERVAL_SECONDS": "3600",
}


@pytest.fixture
def alice(member_setup):
    """alice in team a (bob in team b), allowed to chat, and no executor yet."""
    alice, *_rest, shared = member_setup
    shared.delete()
    return may_chat(alice)


@pytest.fixture(scope="module")
def slow_writer(servers, tmp_path_factory):
    """A model server that writes slowly: half a second between pieces of a tool call's
    arguments, a second and a half in all, so a test can tell live pieces from the end's."""
    processes = Processes(tmp_path_factory.mktemp("slow-writer"))
    try:
        yield processes.simllm(latency_ms=30, models="m", tokens_per_s=2)
    finally:
        processes.stop_all()


@pytest.fixture(scope="module")
def servers(django_db_setup, django_db_blocker, tmp_path_factory):
    """The API server and the model servers, once per module."""
    processes = Processes(tmp_path_factory.mktemp("servers"))
    try:
        with django_db_blocker.unblock():
            yield dict(
                simllm=processes.simllm(latency_ms=30, models="m,e", output_tokens=8),
                slow=processes.simllm(latency_ms=5000, models="m", output_tokens=8),
                trickle=processes.simllm(latency_ms=50, models="m", output_tokens=8, tokens_per_s=8),
                faults=processes.faultserver(),
                # Serves a whole module: bad-credential counts of one test must not throttle the next.
                base=processes.api_server(
                    TELEMACHUS_AUTH_FAILURES_PER_ADDRESS="1000", TELEMACHUS_AUTH_FAILURES_PER_CREDENTIAL="1000"
                ),
            )
    finally:
        processes.stop_all()


@pytest.fixture
def stack(servers, processes) -> Stack:
    """The module's servers and a worker of the test's own: workers are stopped before the test's
    database is flushed, which would otherwise deadlock now and then with a worker's claim."""
    processes.worker("w1", concurrency=16, **WORKER_ENV)
    return Stack(processes=processes, **servers)
