"""Rates at the gateway's entries, on a running API server: /v1/ calls and opens of the job API's wait
and stream, per user, each refused past its rate with 429 and Retry-After in its surface's shape."""

import httpx
import pytest

from scheduler.services.submit import job_submit
from tests.processes import Processes
from tests.scheduler.gateway.conftest import may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def base(django_db_setup, django_db_blocker, tmp_path_factory):
    processes = Processes(tmp_path_factory.mktemp("rates"))
    try:
        with django_db_blocker.unblock():
            yield processes.api_server(TELEMACHUS_OPENAI_RATE="3/min", TELEMACHUS_STREAM_RATE="3/min")
    finally:
        processes.stop_all()


def test_v1_calls_past_the_rate_are_429_in_openais_shape(base, member_setup):
    alice, bob = may_chat(member_setup[0]), may_chat(member_setup[1])
    headers = {"Authorization": f"Bearer {token(alice)}"}
    statuses = [httpx.get(f"{base}/v1/models", headers=headers).status_code for _ in range(3)]
    assert statuses == [200, 200, 200]
    # Every /v1/ call counts, whatever it is.
    refused = httpx.post(f"{base}/v1/chat/completions", json={"model": "m"}, headers=headers)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    # Another user has a rate of their own; no token is still a 401, not a 429.
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {token(bob)}"}).status_code == 200
    assert httpx.get(f"{base}/v1/models").status_code == 401


def test_waits_and_streams_past_the_rate_are_429_in_the_apis_shape(base, member_setup):
    alice, bob = member_setup[0], member_setup[1]
    job = job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    headers = {"Authorization": f"Token {token(alice)}"}
    statuses = []
    for _ in range(2):
        with httpx.stream("GET", f"{base}/api/jobs/{job.pk}/stream/", headers=headers, timeout=30) as stream:
            statuses.append(stream.status_code)
    statuses.append(httpx.get(f"{base}/api/jobs/{job.pk}/wait/?timeout=0", headers=headers).status_code)
    assert statuses == [200, 200, 200]
    refused = httpx.get(f"{base}/api/jobs/{job.pk}/stream/", headers=headers)
    assert refused.status_code == 429, refused.text
    body = refused.json()
    assert body["error"] == "throttled" and refused.headers["retry-after"] == str(body["retry_after"])
    assert 1 <= body["retry_after"] <= 60
    assert httpx.get(f"{base}/api/jobs/{job.pk}/wait/?timeout=0", headers=headers).status_code == 429
    # Bob's opens are his own (his 404: the job is not his to see).
    assert (
        httpx.get(
            f"{base}/api/jobs/{job.pk}/wait/?timeout=0", headers={"Authorization": f"Token {token(bob)}"}
        ).status_code
        == 404
    )
