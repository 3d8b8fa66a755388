"""Body retention 0 against a running stack: a /v1/ caller (plain and streamed) and a /wait/
caller get their answer, then the workers remove the prompt and the answer, and nothing of them
stays anywhere in the database."""

import httpx
import pytest
from openai import OpenAI

from scheduler.models import Job
from telemachus.models import Team
from tests.processes import wait_until
from tests.scheduler.gateway.conftest import WORKER_ENV, model_executor, token
from tests.scheduler.services.test_retention import database_holds

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

MARKER = "okapi-91d2-confidential"


@pytest.fixture
def pruning(servers, processes, alice):
    """The module's servers, a worker that prunes every second, and alice's team removing bodies at once."""
    Team.objects.filter(slug="a").update(body_retention_hours=0)
    processes.worker("w1", concurrency=8, TELEMACHUS_PRUNE_INTERVAL_SECONDS="1", **WORKER_ENV)
    return servers


def removed(job_id: int) -> bool:
    return Job.objects.filter(pk=job_id, body_removed_at__isnull=False).exists()


def test_callers_get_their_answer_then_the_body_is_gone(pruning, alice):
    model_executor(pruning["simllm"])
    client = OpenAI(base_url=f"{pruning['base']}/v1", api_key=token(alice), max_retries=0, timeout=60)
    said = [{"role": "user", "content": f"remember {MARKER}"}]
    plain = client.chat.completions.create(model="m", messages=said)
    assert plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model="m", messages=said, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    auth = {"Authorization": f"Token {token(alice)}"}
    body = {
        "type": "chat",
        "team": "a",
        "requirements": {"model": "m"},
        "input": {"messages": said, "max_tokens": 8},
    }
    submitted = httpx.post(f"{pruning['base']}/api/jobs/", json=body, headers=auth).json()
    waited = httpx.get(f"{pruning['base']}/api/jobs/{submitted['id']}/wait/?timeout=5", headers=auth, timeout=20)
    assert waited.json()["status"] == "done" and waited.json()["result"]
    ids = [int(plain.id.removeprefix("chatcmpl-")), submitted["id"]]
    wait_until(lambda: all(removed(job_id) for job_id in ids), timeout=20, what="bodies removed")
    assert len(Job.objects.filter(body_removed_at__isnull=False)) == 3
    assert not database_holds(MARKER)
