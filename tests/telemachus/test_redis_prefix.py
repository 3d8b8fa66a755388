"""Two deployments on one Redis keep apart by REDIS_PREFIX: the cache's keys (bad-credential,
sign-in and throttle counts) were always `telemachus:1:...`, so one deployment's lockout of an
address was the other's too. Two API servers with two prefixes, against the real Redis on
127.0.0.1:6379 (a database of this test's own)."""

import urllib.error
import urllib.request
import uuid
from urllib.parse import urlparse

import pytest
import redis

from tests.scheduler.gateway.conftest import redis_url

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

REDIS_DB = 12
FAILURES = 3


@pytest.fixture
def shared_redis():
    url = redis_url()
    if url is None:
        pytest.skip("needs a Redis on 127.0.0.1:6379")
    parsed = urlparse(url)
    url = f"redis://{parsed.hostname}:{parsed.port or 6379}/{REDIS_DB}"
    tag = uuid.uuid4().hex[:8]
    prefixes = (f"deploy-a-{tag}", f"deploy-b-{tag}")
    client = redis.Redis.from_url(url)
    yield url, prefixes, client
    for prefix in (*prefixes, "telemachus"):
        keys = list(client.scan_iter(f"{prefix}:*"))
        if keys:
            client.delete(*keys)
    client.close()


def status(base: str, token: str) -> int:
    request = urllib.request.Request(f"{base}/api/jobs/", headers={"Authorization": f"Token {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_lockout_in_one_deployment_is_not_anothers(processes, shared_redis):
    url, (prefix_a, prefix_b), client = shared_redis
    env = {"REDIS_URL": url, "TELEMACHUS_AUTH_FAILURES_PER_ADDRESS": str(FAILURES)}
    # Given two deployments sharing one Redis, each with its own prefix...
    deployment_a = processes.api_server("a", REDIS_PREFIX=prefix_a, **env)
    deployment_b = processes.api_server("b", REDIS_PREFIX=prefix_b, **env)

    # When an address guesses tokens at deployment A until it is locked out...
    for guess in range(FAILURES):
        assert status(deployment_a, f"bad-{guess}") == 401
    assert status(deployment_a, "bad-again") == 429

    # Then deployment B has counted nothing against it: a bad token is a plain 401 there...
    assert status(deployment_b, "bad-at-b") == 401
    # ...and every count lives under A's prefix (B's one failure under B's), none under the old fixed one.
    keys_a = [k.decode() for k in client.scan_iter(f"{prefix_a}:*")]
    assert keys_a and all(k.startswith(f"{prefix_a}:1:telemachus:authfail:") for k in keys_a), keys_a
    assert list(client.scan_iter(f"{prefix_b}:*"))
    assert not list(client.scan_iter("telemachus:1:*"))
    # A second API server of deployment A (its prefix) shares A's count: the address stays locked there.
    assert status(processes.api_server("a2", REDIS_PREFIX=prefix_a, **env), "bad-at-a2") == 429
