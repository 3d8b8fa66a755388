"""A streamed tool call reaches the app as the model writes it, in each protocol's own events:
its id and name first, then its arguments in pieces, while the job is still running. Needs
output deltas across processes (PostgreSQL NOTIFY, or Redis)."""

import json

import pytest
from anthropic import Anthropic
from openai import OpenAI

from scheduler.models import Job
from tests.processes import Processes
from tests.scheduler.gateway.conftest import live_deltas, may_chat, token

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not live_deltas(), reason="output reaches the API process only at the end (SQLite, no Redis)"),
]

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGUMENTS = json.dumps({"city": "Paris"})


@pytest.fixture(scope="module")
def slow_writer(servers, tmp_path_factory):
    """A model server that writes slowly: half a second between pieces of a tool call's
    arguments, a second and a half in all, so the test can tell live pieces from the end's."""
    processes = Processes(tmp_path_factory.mktemp("slow-writer"))
    try:
        yield processes.simllm(latency_ms=30, models="m", tokens_per_s=2)
    finally:
        processes.stop_all()


@pytest.fixture
def alice(member_setup):
    alice, *_rest, shared = member_setup
    shared.delete()
    return may_chat(alice)


def running() -> bool:
    return Job.objects.get().status == "running"


def chat(stack, alice) -> tuple[bool, list[str]]:
    client = OpenAI(base_url=f"{stack.base}/v1", api_key=token(alice), max_retries=0)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": PARAMETERS}}]
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Paris"}], tools=tools, stream=True
    )
    started, pieces = None, []
    for chunk in stream:
        for call in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            if started is None:
                started = running()
                assert (call.index, call.function.name) == (0, "weather") and call.id
            if call.function.arguments:
                pieces.append(call.function.arguments)
    return bool(started), pieces


def responses(stack, alice) -> tuple[bool, list[str]]:
    client = OpenAI(base_url=f"{stack.base}/v1", api_key=token(alice), max_retries=0)
    tools = [{"type": "function", "name": "weather", "parameters": PARAMETERS}]
    started, pieces = None, []
    with client.responses.stream(model="m", input="Paris", tools=tools) as events:
        for event in events:
            if event.type == "response.output_item.added" and event.item.type == "function_call":
                started = running()
                assert event.item.name == "weather" and event.output_index == 0
            if event.type == "response.function_call_arguments.delta":
                pieces.append(event.delta)
        final = events.get_final_response()
    assert final.output[0].arguments == ARGUMENTS
    return bool(started), pieces


def messages(stack, alice) -> tuple[bool, list[str]]:
    client = Anthropic(base_url=stack.base, api_key=token(alice), max_retries=0)
    tools = [{"name": "weather", "input_schema": PARAMETERS}]
    started, pieces = None, []
    with client.messages.stream(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "Paris"}], tools=tools
    ) as events:
        for event in events:
            if event.type == "content_block_start" and event.content_block.type == "tool_use":
                started = running()
                assert event.content_block.name == "weather" and event.index == 0
            if event.type == "input_json":
                pieces.append(event.partial_json)
        final = events.get_final_message()
    assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    return bool(started), pieces


@pytest.mark.parametrize("protocol", [chat, responses, messages], ids=["chat", "responses", "messages"])
def test_a_tool_call_streams_as_the_model_writes_it(stack, alice, slow_writer, protocol):
    stack.executor(slow_writer)
    started_while_running, pieces = protocol(stack, alice)
    assert started_while_running, "the call was announced while the model was still writing it"
    assert "".join(pieces) == ARGUMENTS
    assert len(pieces) > 1, f"the arguments came in pieces, not whole at the end: {pieces}"
