"""Each model API streams as the model writes: a tool call's id and name first, then its
arguments in pieces, and the text word by word, in each protocol's own events and before the job
ends. Needs output deltas across processes (PostgreSQL NOTIFY, or Redis).

The stream is read as raw lines (the SDKs' own handling of these streams is tested in
openai/, responses/ and anthropic/ test_endpoint.py): the time a line arrives is then the time
the gateway sent it, whatever the SDK's parsing costs on a busy machine."""

# ruff: noqa: E501 (a table of requests, one a line)

import json
import time

import httpx
import pytest

from scheduler.models import Job
from tests.scheduler.gateway.conftest import live_deltas, token

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not live_deltas(), reason="output reaches the API process only at the end (SQLite, no Redis)"),
]

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGUMENTS = json.dumps({"city": "Paris"})
USER = [{"role": "user", "content": "Paris"}]


def chat(event: dict) -> tuple[bool, str, str]:
    """(announces a tool call, a piece of its arguments, a piece of text) in a chat completions
    chunk."""
    deltas = [choice["delta"] for choice in event.get("choices") or ()]
    calls = [c for delta in deltas for c in delta.get("tool_calls") or ()]
    return (
        any(c.get("id") for c in calls),
        "".join(c["function"].get("arguments") or "" for c in calls),
        "".join(delta.get("content") or "" for delta in deltas),
    )


def responses(event: dict) -> tuple[bool, str, str]:
    added = event["type"] == "response.output_item.added" and event["item"]["type"] == "function_call"
    piece = event["delta"] if event["type"] == "response.function_call_arguments.delta" else ""
    return added, piece, event["delta"] if event["type"] == "response.output_text.delta" else ""


def messages(event: dict) -> tuple[bool, str, str]:
    started = event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use"
    delta = event.get("delta") or {}
    piece = delta.get("partial_json", "") if delta.get("type") == "input_json_delta" else ""
    return started, piece, delta.get("text", "") if delta.get("type") == "text_delta" else ""


PROTOCOLS = {
    "chat": (
        chat,
        "/v1/chat/completions",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "weather", "parameters": PARAMETERS}}]},
    ),
    "responses": (responses, "/v1/responses", {"input": "Paris", "tools": [{"type": "function", "name": "weather", "parameters": PARAMETERS}]}),
    "messages": (messages, "/v1/messages", {"max_tokens": 64, "messages": USER, "tools": [{"name": "weather", "input_schema": PARAMETERS}]}),
}  # fmt: skip


def stream(stack, alice, path: str, body: dict, read) -> tuple[float | None, list[str], float | None, list[str]]:
    """When the first tool call was announced and the first text came, and the pieces of each."""
    announced_at, pieces, texted_at, texts = None, [], None, []
    headers = {"Authorization": f"Bearer {token(alice)}"}
    with httpx.stream(
        "POST", stack.base + path, json={"model": "m", "stream": True, **body}, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            announces, piece, text = read(json.loads(line.removeprefix("data: ")))
            if announces and announced_at is None:
                announced_at = time.time()
            if text and texted_at is None:
                texted_at = time.time()
            pieces += [piece] if piece else []
            texts += [text] if text else []
    return announced_at, pieces, texted_at, texts


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_a_tool_call_streams_as_the_model_writes_it(stack, alice, slow_writer, protocol):
    stack.executor(slow_writer)
    read, path, body = PROTOCOLS[protocol]
    announced_at, pieces, _, _ = stream(stack, alice, path, body, read)
    job = Job.objects.get()
    assert job.status == "done" and job.finished_at is not None
    assert announced_at is not None and announced_at < job.finished_at.timestamp(), (
        "the call was announced while the model was still writing it"
    )
    assert "".join(pieces) == ARGUMENTS
    assert len(pieces) > 1, f"the arguments came in pieces, not whole at the end: {pieces}"


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_text_streams_as_the_model_writes_it(stack, alice, slow_writer, protocol):
    stack.executor(slow_writer)  # half a second a word, four in all
    read, path, body = PROTOCOLS[protocol]
    body = {k: v for k, v in body.items() if k != "tools"} | {
        "max_tokens" if protocol != "responses" else "max_output_tokens": 3
    }
    _, _, texted_at, texts = stream(stack, alice, path, body, read)
    job = Job.objects.get()
    assert texted_at is not None and texted_at < job.finished_at.timestamp(), "text came while the model wrote"
    assert "".join(texts) == job.result["message"]["content"] and len(texts) > 2
