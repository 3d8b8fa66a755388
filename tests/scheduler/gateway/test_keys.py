"""API keys as apps use them, against the API server, real workers and real model servers: a key made over
the API works with the official `openai` SDK on /v1/ and with plain HTTP on /api/, is bound to its
models, its slots and its money, and stops working in every API process once revoked. Its secret
is nowhere to be found afterwards: not in the database, not in a log."""

import concurrent.futures
import os
import subprocess
import time
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
from django.db import connection
from openai import OpenAI

from quotas.models import QuotaPolicy, Spend, Usage
from scheduler.models import Job
from telemachus.keys.models import ApiKey
from telemachus.models import Membership
from tests.scheduler.gateway.conftest import may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "hello there"}]  # 6 prompt tokens (tokens.py)


@pytest.fixture
def team_a(member_setup, make_user):
    """Team a with carol, its manager (alice is a member); no executor yet."""
    alice, bob, team, _team_b, shared = member_setup
    shared.delete()
    carol = make_user("carol")
    Membership.objects.create(team=team, user=carol, role="manager")
    carol.groups.add(team.group)
    return carol


def http(stack, secret: str | None = None, base: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return httpx.Client(base_url=base or stack.base, headers=headers, timeout=60)


def make_key(stack, manager, **body) -> dict:
    """A key made as an app's owner makes it: POST /api/keys/ with the manager's token."""
    response = http(stack, token(manager)).post("/api/keys/", json={"team": "a", "name": "app", **body})
    assert response.status_code == 201, response.text
    created = response.json()
    # Team grants are guardian object permissions, which a long-lived server caches per content
    # type id; the test database's flushes renumber those (see conftest.may_chat).
    may_chat(ApiKey.objects.get(pk=created["id"]).principal)
    return created


def sdk(stack, secret: str, **options) -> OpenAI:
    options.setdefault("base_url", f"{stack.base}/v1")
    return OpenAI(api_key=secret, max_retries=0, timeout=60, **options)


def test_a_key_on_v1_and_api_then_revoked_everywhere_within_a_second(stack, team_a, processes, tmp_path_factory):
    stack.executor(stack.simllm, models=["m", "e"])
    second = processes.api_server("api2")  # another API process, as behind a load balancer
    created = make_key(stack, team_a, models=["m"])
    secret = created["key"]
    assert secret.startswith("tm-")

    # The official SDK: only the key's models are listed, a call acts for team a as the key.
    client = sdk(stack, secret)
    assert [m.id for m in client.models.list()] == ["m"]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=HELLO, max_tokens=4)
    reply = raw.parse()
    assert reply.choices[0].message.content.startswith("[simulated by simllm]")
    job = Job.objects.get(pk=int(raw.headers["x-telemachus-job"]))
    assert (job.team.slug, job.user.username, job.key_id) == ("a", created["principal"], created["id"])
    assert raw.headers["x-telemachus-cost"] == "0" and raw.headers["x-telemachus-currency"] == "USD"
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="e", messages=HELLO)
    assert (refused.value.code, refused.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("e")

    # Plain HTTP on /api/: no team named, the key's is used; the job API's wait works too.
    app = http(stack, secret)
    submitted = app.post(
        "/api/jobs/",
        json={"type": "chat", "requirements": {"model": "m"}, "input": {"messages": HELLO, "max_tokens": 2}},
    )
    assert submitted.status_code == 201, submitted.text
    waited = app.get(f"/api/jobs/{submitted.json()['id']}/wait/?timeout=30")
    assert waited.json()["status"] == "done" and waited.json()["key"] == created["id"]
    assert http(stack, secret, second).get("/api/jobs/").status_code == 200
    assert sdk(stack, secret, base_url=f"{second}/v1").models.list().data[0].id == "m"

    # Revoked: refused by both API processes at once (each is asked right after the revoke
    # answers), then on /v1/ and /api/ alike.
    apps = {base: http(stack, secret, base) for base in (stack.base, second)}
    personal = token(team_a)  # the manager's own token: stored as a digest too
    assert http(stack, personal).delete(f"/api/keys/{created['id']}/").status_code == 204
    revoked_at = time.monotonic()
    for base, app in apps.items():
        assert app.get("/v1/models").status_code == 401
        assert time.monotonic() - revoked_at < 1.0, f"{base} refused the revoked key within a second"
    for base in apps:
        assert http(stack, secret, base).get("/api/jobs/").status_code == 401
        with pytest.raises(openai.AuthenticationError) as caught:
            sdk(stack, secret, base_url=f"{base}/v1").chat.completions.create(model="m", messages=HELLO)
        assert caught.value.code == "invalid_api_key"
        assert http(stack, secret, base).get(f"/api/jobs/{job.pk}/wait/?timeout=0").status_code == 401

    # The secrets are in no row of any table, no dump of the database, and no process's log.
    assert_nowhere(secret, logs=Path(tmp_path_factory.getbasetemp()))
    assert_nowhere(personal, logs=Path(tmp_path_factory.getbasetemp()))


def assert_nowhere(secret: str, *, logs: Path) -> None:
    needle = secret.partition("-")[2]  # the random part
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            for row in cursor.fetchall():
                assert needle not in repr(row), table
    if connection.vendor == "postgresql":
        settings = connection.settings_dict
        dump = subprocess.run(
            ["pg_dump", "-h", settings["HOST"] or "127.0.0.1", "-U", settings["USER"] or "postgres", settings["NAME"]],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PGPASSWORD": settings.get("PASSWORD") or ""},
        ).stdout
        assert "telemachus_apikey" in dump and "telemachus_personaltoken" in dump and needle not in dump
    files = list(logs.rglob("*.log"))
    assert any(f.name.startswith("api") for f in files) and any(f.name.startswith("w1") for f in files)
    for log in files:
        assert needle not in log.read_text(errors="replace"), log


def test_a_key_cap_of_two_holds_ten_concurrent_calls(stack, team_a):
    executor = stack.executor(stack.trickle, max_concurrency=8)
    created = make_key(stack, team_a)
    QuotaPolicy.objects.create(scope="key", subject=str(created["id"]), dimension="ai.concurrency", limit=2)
    client = sdk(stack, created["key"])

    def call(i: int) -> str:
        return client.chat.completions.create(model="m", messages=HELLO, max_tokens=4).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(call, range(10)))
    assert len(answers) == 10 and all(answer.startswith("[simulated by simllm]") for answer in answers)
    stats = stack.stats(executor)
    assert stats["requests"] == 10
    assert stats["peak"] == 2, f"never more than the key's 2 at the model server, and it used both: {stats}"
    queue = http(stack, token(team_a)).get("/api/queue/").json()
    (shown,) = [k for k in queue["keys"] if k["id"] == created["id"]]
    assert (shown["cap"], shown["in_use"], shown["name"]) == (2, 0, "app")


def test_a_money_budget_of_a_fraction_of_a_cent(stack, team_a):
    # Per 1M tokens: 100 in, 500 out. A call: 6 prompt tokens and 4 completion tokens (max_tokens)
    # = 600 + 2000 millionths = 0.0026. The budget, 0.008, pays for three.
    executor = stack.executor(stack.simllm, prices={"m": {"input": "100", "output": "500"}})
    created = make_key(stack, team_a)
    QuotaPolicy.objects.create(
        scope="key", subject=str(created["id"]), dimension="ai.cost", limit=Decimal("0.008"), window="day"
    )
    client = sdk(stack, created["key"])
    costs = []
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="m", messages=HELLO, max_tokens=4)
        usage = raw.parse().usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (6, 4)
        costs.append(raw.headers["x-telemachus-cost"])
    assert costs == ["0.0026"] * 3
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="m", messages=HELLO, max_tokens=4)
    assert refused.value.code == "quota_exceeded"
    assert "ai.cost" in refused.value.message
    row = Usage.objects.get(scope="key", subject=str(created["id"]))
    assert row.cost == Decimal("0.0078") == 3 * (6 * Decimal(100) + 4 * Decimal(500)) / 1_000_000
    assert row.reserved_cost == 0
    assert sum(Job.objects.filter(key_id=created["id"]).values_list("cost", flat=True)) == Decimal("0.0078")
    assert Spend.objects.get(key_id=created["id"]).cost == Decimal("0.0078")
    spend = http(stack, created["key"]).get("/api/spend/").json()
    assert spend["total"]["cost"] == "0.0078" and spend["total"]["tokens"] == 30
    assert stack.stats(executor)["requests"] == 3, "the refused call never reached the model server"


def test_bad_keys_from_one_address_are_throttled(stack, team_a, processes):
    base = processes.api_server("api-strict", TELEMACHUS_AUTH_FAILURES_PER_ADDRESS="3")
    for guess in range(3):
        assert http(stack, f"tm-guess{guess}", base).get("/v1/models").status_code == 401
    throttled = http(stack, "tm-guess3", base).get("/v1/models")
    assert throttled.status_code == 429 and throttled.json()["error"]["code"] == "too_many_authentication_failures"
    assert 0 < int(throttled.headers["retry-after"]) <= 60
    assert http(stack, "tm-guess4", base).get("/api/jobs/").status_code == 429
    assert http(stack, "tm-guess5", base).get("/api/jobs/1/wait/").status_code == 429
