"""The status line the server sends: an ASGI response has a status but no reason phrase, and
Twisted's table lacks 429, so a throttled client read `429 Unknown Status` from daphne. Both ways
a 429 leaves the app (Django's exception handler, the gateway's raw ASGI answer ahead of Django)
must say `Too Many Requests`, under either server bin/run may start."""

import http.client
import json
from urllib.parse import urlsplit

import pytest

from quotas.models import QuotaPolicy
from tests.conftest import chat_body
from tests.credentials import token_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def post(base: str, path: str, token: str, body: dict, **headers: str) -> http.client.HTTPResponse:
    url = urlsplit(base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    connection.request(
        "POST",
        path,
        body=json.dumps(body),
        headers={"Authorization": token, "Content-Type": "application/json", **headers},
    )
    response = connection.getresponse()
    response.read()
    connection.close()
    return response


@pytest.mark.parametrize("server", ["uvicorn", "daphne"])
def test_a_429_says_too_many_requests_from_django_and_from_the_gateway(processes, member_setup, server):
    # Given team a's daily token budget, too small for any job...
    alice, *_ = member_setup
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=1, window="day")
    key = token_for(alice)
    base = processes.api_server(TELEMACHUS_SERVER=server)

    # When alice submits through the job API (Django) and the OpenAI endpoint (the gateway)...
    api = post(base, "/api/jobs/", f"Token {key}", chat_body("a"))
    gateway = post(
        base,
        "/v1/chat/completions",
        f"Bearer {key}",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
        **{"X-Telemachus-Team": "a"},
    )

    # Then both are refused with the standard reason phrase.
    assert (api.status, api.reason) == (429, "Too Many Requests")
    assert (gateway.status, gateway.reason) == (429, "Too Many Requests")
