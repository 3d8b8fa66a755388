"""A streamed job's output reaches the API processes while the model writes: through PostgreSQL
NOTIFY, or through Redis from a worker to any API process. Each test starts its own API processes
and worker (the module-wide stack of the other tests would run the jobs too)."""

import threading
import uuid

import httpx
import pytest

from scheduler.models import Job
from tests.conftest import chat_body
from tests.processes import Processes
from tests.scheduler.gateway.conftest import WORKER_ENV, model_executor, redis_url, token
from tests.scheduler.gateway.test_jobwatch import auth, events, submit

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


TRANSPORTS = ["notify", "redis"]


def live_stack(processes: Processes, transport: str, on_postgres: bool, apis: int = 1) -> tuple[list[str], str]:
    """API processes, a worker and a slowly streaming model server, sharing deltas through
    PostgreSQL NOTIFY or Redis."""
    env = {"REDIS_URL": ""}
    if transport == "notify" and not on_postgres:
        pytest.skip("NOTIFY needs PostgreSQL")
    if transport == "redis":
        url = redis_url()
        if url is None:
            pytest.skip("no Redis on 127.0.0.1:6379")
        env = {"REDIS_URL": url, "REDIS_PREFIX": f"test-{uuid.uuid4().hex[:8]}"}
    server = processes.simllm(latency_ms=500, models="m", output_tokens=8, tokens_per_s=8)
    processes.worker("w", concurrency=8, **WORKER_ENV, **env)
    return [processes.api_server(f"api{i}", **env) for i in range(apis)], server


def warm(api: str, user) -> None:
    """A first request, so the API process's job feed is listening before the test's job starts."""
    httpx.get(f"{api}/api/jobs/0/wait/?timeout=0", headers=auth(user), timeout=30)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_stream_shows_output_while_the_model_writes(processes, alice, transport, on_postgres):
    (api,), server = live_stack(processes, transport, on_postgres)
    model_executor(server)
    warm(api, alice)
    job = submit(alice, stream=True)
    deltas, running_at_first_delta, seen = [], None, []
    with httpx.stream("GET", f"{api}/api/jobs/{job.pk}/stream/", headers=auth(alice), timeout=60) as response:
        for name, data in events(response):
            seen.append(name)
            if name == "delta":
                if running_at_first_delta is None:
                    running_at_first_delta = Job.objects.get(pk=job.pk).status == "running"
                deltas.append(data)
            if name == "done":
                final = data
    assert running_at_first_delta, "output arrived while the job was still running"
    assert final["status"] == "done" and "".join(d["text"] for d in deltas) == final["result"]["message"]["content"]
    assert [d["offset"] for d in deltas] == [sum(len(d["text"]) for d in deltas[:i]) for i in range(len(deltas))]
    assert "status" in seen and seen.index("delta") < seen.index("done")


def test_a_stream_on_one_api_process_shows_a_job_another_submitted_and_a_worker_ran(processes, alice, on_postgres):
    (first, second), server = live_stack(processes, "redis", on_postgres, apis=2)
    model_executor(server)
    warm(first, alice)
    warm(second, alice)
    # Given a streamed job submitted through the second API process
    submitted = httpx.post(
        f"{second}/api/jobs/",
        headers=auth(alice),
        timeout=30,
        json=chat_body("a", input={"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    )
    assert submitted.status_code == 201
    job_id = submitted.json()["id"]
    # And a streamed call to the second one too, relayed while it runs
    relayed: list[str] = []
    key = token(alice)  # read here: a thread of its own would leave a database connection open
    caller = threading.Thread(target=lambda: relayed.extend(stream_through_sdk(second, key)))
    caller.start()
    # When the first API process streams the job
    deltas, running_at_first_delta = [], None
    with httpx.stream("GET", f"{first}/api/jobs/{job_id}/stream/", headers=auth(alice), timeout=60) as response:
        for name, data in events(response):
            if name == "delta":
                running_at_first_delta = running_at_first_delta or Job.objects.get(pk=job_id).status == "running"
                deltas.append(data["text"])
            if name == "done":
                final = data
    caller.join(timeout=60)
    # Then it relays the output the worker received, live, and ends with the job
    assert running_at_first_delta and len(deltas) > 2
    assert "".join(deltas) == final["result"]["message"]["content"] and final["status"] == "done"
    assert len(relayed) > 2 and "".join(relayed).endswith("sim7")


def stream_through_sdk(api: str, key: str) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=60)
    chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
