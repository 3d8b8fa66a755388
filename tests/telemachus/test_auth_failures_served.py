"""Bad credentials against a served API (the ASGI app as bin/run serves it): from one address,
past its limit, the bad ones are answered 429 on every surface (the DRF API, /v1/, the job API's
long polls), while every right key and token from that same address is served as before."""

import httpx
import pytest

from scheduler.services.submit import job_submit
from telemachus.keys.services import api_key_create
from tests.credentials import token_for
from tests.scheduler.gateway.conftest import may_chat

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def get(base: str, path: str, authorization: str) -> httpx.Response:
    return httpx.get(f"{base}{path}", headers={"Authorization": authorization}, timeout=30)


def test_a_guessing_neighbour_locks_out_nobody(processes, member_setup):
    alice, _bob, team_a, *_ = member_setup
    may_chat(alice)
    key, key_secret = api_key_create(team=team_a, name="app")
    may_chat(key.principal)
    token = token_for(alice)
    job = job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    base = processes.api_server("api-auth", TELEMACHUS_AUTH_FAILURES_PER_ADDRESS="3")

    guesses = [get(base, "/v1/models", f"Bearer tm-guess{n:028d}").status_code for n in range(3)]
    assert guesses == [401, 401, 401]
    refused = {
        path: get(base, path, f"{keyword} tm-guess{n:028d}")
        for n, (path, keyword) in enumerate(
            [("/v1/models", "Bearer"), ("/api/jobs/", "Token"), (f"/api/jobs/{job.pk}/wait/?timeout=0", "Bearer")],
            start=10,
        )
    }
    assert {path: r.status_code for path, r in refused.items()} == dict.fromkeys(refused, 429)
    assert refused["/v1/models"].json()["error"]["code"] == "too_many_authentication_failures"
    assert all(0 < int(r.headers["retry-after"]) <= 60 for r in refused.values())

    # The same address, still over its limit: the right key and token are served on each surface.
    for _ in range(3):
        assert get(base, "/v1/models", f"Bearer {key_secret}").status_code == 200
        assert get(base, "/v1/models", f"Bearer {token}").status_code == 200
        assert get(base, "/api/jobs/", f"Token {token}").status_code == 200
        assert get(base, "/api/jobs/", f"Bearer {key_secret}").status_code == 200
        waited = get(base, f"/api/jobs/{job.pk}/wait/?timeout=0", f"Token {token}")
        assert waited.status_code == 200 and waited.json()["id"] == job.pk
        assert get(base, "/v1/models", "Bearer tm-guess-again").status_code == 429
