"""OpenAI's Files and Batches APIs and Anthropic's Message Batches, as apps use them: the official
SDKs against the API server, with real workers feeding and running the lines on a real model
server (simllm). Each batch's lines are governed jobs of the caller's team, and each custom_id is
answered once, in the output or the error file."""

import io
import json
import time
from datetime import timedelta
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest
from anthropic import Anthropic
from django.utils import timezone
from openai import OpenAI

from quotas.models import QuotaPolicy
from scheduler.batches.models import Batch, BatchLine, StoredFile
from scheduler.models import Job
from scheduler.services.retention import prune_once
from telemachus.keys.services import api_key_create
from telemachus.models import Team
from tests.processes import wait_until
from tests.scheduler.gateway.conftest import WORKER_ENV, may_chat, token
from tests.scheduler.services.test_retention import MARKER, database_holds

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

FAST = {**WORKER_ENV, "TELEMACHUS_BATCH_FEED_SECONDS": "0.05"}


def sdk(stack, secret: str) -> OpenAI:
    return OpenAI(api_key=secret, base_url=f"{stack.base}/v1", max_retries=0, timeout=60)


def jsonl(lines: list) -> io.BytesIO:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return io.BytesIO(text.encode())


def chat_line(custom_id: str, model: str = "m", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": f"hello {custom_id}"}],
            "max_tokens": 4,
            **body,
        },
    }


def finished(client: OpenAI, batch_id: str, *, timeout: float = 60):
    return wait_until(
        lambda: (
            (b := client.batches.retrieve(batch_id)).status in ("completed", "failed", "expired", "cancelled") and b
        ),
        timeout=timeout,
        interval=0.1,
        what=f"batch {batch_id} to end",
    )


def entries(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


@pytest.fixture
def feeding(stack, processes):
    """A second worker that feeds batches often (the stack's own feeds at the default pace)."""
    processes.worker("feeder", concurrency=16, **FAST)
    return stack


def test_upload_create_poll_results_with_the_openai_sdk(feeding, alice):
    stack = feeding
    stack.executor(stack.simllm, models=["m"])
    client = sdk(stack, token(alice))
    lines = [chat_line(f"req-{i}") for i in range(40)]
    lines[7] = chat_line("req-7", messages=[])  # refused as a live call would be: in the error file

    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.status) == ("file", "batch", "processed")
    assert client.files.retrieve(uploaded.id).bytes == len(jsonl(lines).getvalue())
    assert client.files.content(uploaded.id).content == jsonl(lines).getvalue()

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "one"}
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 40
    assert batch.metadata == {"run": "one"}

    done = finished(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (40, 39, 1)
    output, errors = entries(client, done.output_file_id), entries(client, done.error_file_id)
    assert sorted(e["custom_id"] for e in output + errors) == sorted(f"req-{i}" for i in range(40))
    first = next(e for e in output if e["custom_id"] == "req-0")
    assert first["response"]["status_code"] == 200 and first["error"] is None
    assert first["response"]["body"]["object"] == "chat.completion"
    assert first["response"]["body"]["choices"][0]["message"]["content"].startswith("[simulated by simllm]")
    (refused,) = errors
    assert refused["custom_id"] == "req-7" and refused["error"]["line"] == 8 and refused["response"] is None

    # Every line was a governed chat job of team a, at the lowest priority, named by its batch.
    jobs = Job.objects.filter(batch_id=batch.id)
    assert jobs.count() == 39 and {j.team.slug for j in jobs} == {"a"}
    assert {j.priority for j in jobs} == {Job.PRIORITY_MIN} and {j.status for j in jobs} == {"done"}

    # Listing pages with a cursor; another team sees nothing of it.
    second = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    listed = client.batches.list(limit=1)
    assert [b.id for b in listed.data] == [second.id] and listed.has_more
    assert [b.id for b in client.batches.list(limit=1, after=second.id).data] == [batch.id]
    finished(client, second.id)
    assert any(f.id == uploaded.id for f in client.files.list().data)
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_malformed_lines_fail_the_batch_naming_each_line(feeding, alice):
    stack = feeding
    stack.executor(stack.simllm, models=["m"])
    client = sdk(stack, token(alice))
    lines = [chat_line("a"), "{not json", chat_line("a"), {**chat_line("c"), "url": "/v1/embeddings"}]
    uploaded = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
    ]
    assert not Job.objects.filter(batch_id=batch.id).exists()
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")


def test_a_keys_models_and_a_budget_that_runs_out_mid_batch(feeding, alice, make_user):
    stack = feeding
    stack.executor(stack.simllm, models=["m", "n"])
    key, secret = api_key_create(team=Team.objects.get(slug="a"), name="app", models=["m"])
    may_chat(key.principal)
    client = sdk(stack, secret)
    # 20 lines of model m within the budget, one of a model the key may not call, then a budget
    # of 25 requests a day for the key's principal: lines past it fail with the quota error.
    lines = [chat_line(f"r{i}") for i in range(30)]
    lines[3] = chat_line("r3", model="n")
    QuotaPolicy.objects.create(scope="key", subject=str(key.pk), dimension="ai.requests", limit=25, window="day")
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(client, batch.id)
    output, errors = entries(client, done.output_file_id), entries(client, done.error_file_id)
    assert sorted(e["custom_id"] for e in output + errors) == sorted(f"r{i}" for i in range(30))
    by_id = {e["custom_id"]: e for e in errors}
    assert by_id["r3"]["error"]["code"] == "unknown_model" and by_id["r3"]["error"]["line"] == 4
    quota = [e for e in errors if e["custom_id"] != "r3"]
    assert len(output) == 25 and len(quota) == 4
    assert all(e["error"]["code"] == "quota_exceeded" for e in quota)


def test_cancel_keeps_what_was_answered_and_expiry_keeps_the_finished_part(feeding, alice, operator):
    stack = feeding
    # Three slots of four for batch lines (the default batch_share, 0.75).
    stack.executor(stack.slow, models=["m"], max_concurrency=4)
    client = sdk(stack, token(alice))
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(f"c{i}") for i in range(20)])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: Job.objects.filter(batch_id=batch.id, status="running").count() == 3, timeout=30)
    # Its progress is in the metrics while it runs.
    metrics = httpx.get(f"{stack.base}/metrics", headers={"Authorization": f"Token {token(operator)}"}).text
    assert f'telemachus_batch_requests{{batch="{batch.id}",state="total",team="a"}} 20.0' in metrics
    assert f'telemachus_batch_requests{{batch="{batch.id}",state="running",team="a"}} 20.0' in metrics
    asked = time.monotonic()
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    wait_until(lambda: not Job.objects.filter(batch_id=batch.id, status="queued").exists(), timeout=1)
    assert time.monotonic() - asked < 1.5
    done = finished(client, batch.id)
    assert done.status == "cancelled"
    output, errors = entries(client, done.output_file_id), entries(client, done.error_file_id)
    assert len(output) == 3  # the three running lines finished and were kept
    assert sorted(e["custom_id"] for e in output + errors) == sorted(f"c{i}" for i in range(20))
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}

    # Expiry: the window's end comes while three lines run; what finished is kept.
    expiring = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_until(lambda: Job.objects.filter(batch_id=expiring.id, status="running").count() == 3, timeout=30)
    Batch.objects.filter(pk=expiring.id).update(expires_at=Batch.objects.get(pk=expiring.id).created_at)
    done = finished(client, expiring.id)
    assert done.status == "expired" and done.expired_at is not None
    output, errors = entries(client, done.output_file_id), entries(client, done.error_file_id)
    assert len(output) == 3 and {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(output) + len(errors) == 20


def test_message_batches_with_the_anthropic_sdk(feeding, alice):
    stack = feeding
    stack.executor(stack.simllm, models=["m"])
    client = Anthropic(api_key=token(alice), base_url=stack.base, max_retries=0, timeout=60)
    requests = [
        {
            "custom_id": f"q{i}",
            "params": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(10)
    ]
    requests[4]["params"]["messages"] = []  # errored, as the live call would be refused
    created = client.messages.batches.create(requests=requests)
    assert created.processing_status == "in_progress" and created.id.startswith("msgbatch_")
    ended = wait_until(
        lambda: (b := client.messages.batches.retrieve(created.id)).processing_status == "ended" and b,
        timeout=60,
        interval=0.1,
    )
    assert (ended.request_counts.succeeded, ended.request_counts.errored) == (9, 1)
    results = {r.custom_id: r.result for r in client.messages.batches.results(created.id)}
    assert sorted(results) == sorted(f"q{i}" for i in range(10))
    assert results["q0"].type == "succeeded" and results["q0"].message.content[0].text.startswith("[simulated")
    assert results["q4"].type == "errored"
    assert [b.id for b in client.messages.batches.list(limit=5).data] == [created.id]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_nope")


def test_batch_lines_pay_the_models_batch_price(feeding, alice):
    # Per 1M tokens: 100 in and 500 out live, half that for a batch's line. A call: 6 prompt
    # tokens and 4 completion tokens (max_tokens) = 0.0026 live, 0.0013 in a batch.
    stack = feeding
    stack.executor(
        stack.simllm,
        models=["m"],
        prices={"m": {"input": "100", "output": "500", "batch_input": "50", "batch_output": "250"}},
    )
    client = sdk(stack, token(alice))
    hello = [{"role": "user", "content": "hello there"}]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=hello, max_tokens=4)
    assert raw.headers["x-telemachus-cost"] == "0.0026"
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": hello, "max_tokens": 4},
    }
    uploaded = client.files.create(file=("in.jsonl", jsonl([line, {**line, "custom_id": "y"}])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert finished(client, batch.id).status == "completed"
    costs = Job.objects.filter(batch_id=batch.id).values_list("cost", flat=True)
    assert list(costs) == [Decimal("0.0013")] * 2


def test_retention_removes_a_batchs_prompts_and_answers_then_the_batch(feeding, alice):
    # Given two batches of team a that ended, their prompts (and a Responses line's instructions)
    # holding a marker...
    stack = feeding
    stack.executor(stack.simllm, models=["m"])
    client = sdk(stack, token(alice))
    chats = [chat_line(f"req-{i}", messages=[{"role": "user", "content": f"{MARKER} {i}"}]) for i in range(5)]
    respond = {
        "custom_id": "resp",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "m", "input": f"{MARKER} input", "instructions": f"{MARKER} instructions"},
    }
    created = []
    for lines, endpoint in ((chats, "/v1/chat/completions"), ([respond], "/v1/responses")):
        uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
        created.append(finished(client, batch.id))
    assert [b.status for b in created] == ["completed", "completed"]
    assert database_holds(MARKER)

    # ...when the team removes prompts and answers at once and retention passes...
    team = Team.objects.get(slug="a")
    Team.objects.filter(pk=team.pk).update(body_retention_hours=0)
    prune_once()

    # Then nothing of them stays in the database; the batches stay, with their counts, but no
    # output, and their files answer 404 naming retention.
    assert not database_holds(MARKER), database_holds(MARKER)
    kept = client.batches.retrieve(created[0].id)
    assert kept.status == "completed" and kept.request_counts.completed == 5 and kept.output_file_id is None
    for file_id in (created[0].output_file_id, created[0].input_file_id):
        with pytest.raises(openai.NotFoundError, match="retention"):
            client.files.content(file_id)

    # And once they ended longer ago than the team keeps anything, they go whole, with their
    # jobs, lines and files, and answer 404 naming retention.
    Team.objects.filter(pk=team.pk).update(retention_hours=1)
    then = timezone.now() - timedelta(hours=2)
    Batch.objects.filter(team=team).update(completed_at=then, ended_at=then)
    Job.objects.filter(team=team).update(finished_at=then)
    prune_once()
    assert not Batch.objects.filter(team=team).exists() and not Job.objects.filter(team=team).exists()
    assert not BatchLine.objects.exists() and not StoredFile.objects.filter(team=team).exists()
    with pytest.raises(openai.NotFoundError, match="retention"):
        client.batches.retrieve(created[0].id)
