"""With REDIS_URL set, live connections stay up while idle: the channel layer's blocking read
(BZPOPMIN, 5 s) must not outlast the Redis client's socket timeout, or every idle dashboard socket
is closed with 1011 and the job feed logs a timeout every few seconds. Against a real Redis on
127.0.0.1:6379 (a database and key prefix of this test's own), with the API server."""

import asyncio
import re
import time
import uuid
from urllib.parse import urlparse

import httpx
import pytest
import redis
from django.test import Client

from scheduler.services.submit import job_submit
from tests.conftest import chat_body
from tests.scheduler.gateway.conftest import may_chat, redis_url, token
from tests.wsclient import WebSocket

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HOLD_SECONDS = 60
DASHBOARDS = 10
# A database of the Redis server that nothing else on the machine uses by default.
REDIS_DB = 13
TROUBLE = re.compile(r"Timeout|Traceback|WARNING|ERROR|CRITICAL")


@pytest.fixture
def redis_env():
    url = redis_url()
    if url is None:
        pytest.skip("needs a Redis on 127.0.0.1:6379")
    parsed = urlparse(url)
    url = f"redis://{parsed.hostname}:{parsed.port or 6379}/{REDIS_DB}"
    prefix = f"hharden-{uuid.uuid4().hex[:8]}"
    yield {"REDIS_URL": url, "REDIS_PREFIX": prefix, "LOG_LEVEL": "INFO"}
    client = redis.Redis.from_url(url)
    for pattern in (f"{prefix}*", "telemachus:*"):
        keys = list(client.scan_iter(pattern))
        if keys:
            client.delete(*keys)
    client.close()


def test_idle_dashboards_and_a_stream_stay_up_for_a_minute(processes, member_setup, operator, redis_env):
    # Given the API server on a real Redis, an operator's session, and a job nobody runs (no worker)...
    alice = may_chat(member_setup[0])
    browser = Client()
    browser.force_login(operator)
    session = browser.cookies["sessionid"].value
    body = chat_body("a")
    job = job_submit(user=alice, team="a", type="chat", requirements=body["requirements"], input=body["input"])
    key = token(alice)
    base = processes.api_server(**redis_env)
    port = urlparse(base).port
    log_path = next(p.log_path for p in processes.procs if str(port) in str(p.log_path))

    async def scenario():
        headers = {"Origin": base, "Cookie": f"sessionid={session}"}
        sockets = [await WebSocket.connect("127.0.0.1", port, "/ws/dashboard/", headers) for _ in range(DASHBOARDS)]
        lines: list[str] = []
        ended = asyncio.Event()

        async def stream():
            async with httpx.AsyncClient(timeout=None) as client:
                url = f"{base}/api/jobs/{job.pk}/stream/"
                async with client.stream("GET", url, headers={"Authorization": f"Token {key}"}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        lines.append(line)
            ended.set()

        reader = asyncio.create_task(stream())
        # When all of them sit idle for a minute...
        await asyncio.sleep(HOLD_SECONDS)
        states = [(s.closed, s.close_code, len(s.texts), s.pings) for s in sockets]
        stream_ended = ended.is_set() or reader.done()
        if reader.done() and reader.exception() is not None:
            raise reader.exception()
        reader.cancel()
        for s in sockets:
            await s.close()
        return states, stream_ended, lines

    started = time.monotonic()
    states, stream_ended, lines = asyncio.run(scenario())
    assert time.monotonic() - started >= HOLD_SECONDS

    # Then every dashboard is still open and still hears its heartbeat (every 5 s)...
    assert [(closed, code) for closed, code, _, _ in states] == [(False, None)] * DASHBOARDS, states
    assert all(texts >= HOLD_SECONDS / 5 - 2 for _, _, texts, _ in states), states
    # ...the stream is open, past its first event and keepalives (every 15 s)...
    assert not stream_ended
    assert "event: job" in lines and lines.count(": keepalive") >= HOLD_SECONDS // 15 - 1, lines
    # ...and the server logged no timeout and no error.
    trouble = [line for line in log_path.read_text().splitlines() if TROUBLE.search(line)]
    assert trouble == []
