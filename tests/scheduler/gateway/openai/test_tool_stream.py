"""A streamed tool call as the official `openai` package reads it through /v1/: its pieces arrive
while the model still writes them (the worker relays the model's `tool_calls` deltas as they come),
and the call the client assembles from them is the one a plain call returns. Needs output deltas
across processes (PostgreSQL NOTIFY, or Redis)."""

import json
import time

import pytest
from openai import OpenAI

from scheduler.models import Job
from tests.scheduler.gateway.conftest import live_deltas, token

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not live_deltas(), reason="output reaches the API process only at the end (SQLite, no Redis)"),
]

USER = [{"role": "user", "content": "Paris, in the rain"}]
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def assembled(pieces: list) -> list[dict]:
    """The tool calls as a client builds them from `choices[0].delta.tool_calls` pieces: by index,
    the id, type and name from the piece that has them, the arguments joined."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"id": None, "type": None, "function": {"name": None, "arguments": ""}})
        call["id"] = piece.id or call["id"]
        call["type"] = piece.type or call["type"]
        call["function"]["name"] = (piece.function and piece.function.name) or call["function"]["name"]
        call["function"]["arguments"] += (piece.function and piece.function.arguments) or ""
    return [calls[index] for index in sorted(calls)]


def test_the_sdk_sees_tool_call_deltas_before_the_end_and_assembles_the_plain_answer(stack, alice, slow_writer):
    # Given a model that takes seconds to write a tool call's arguments
    stack.executor(slow_writer)
    client = OpenAI(base_url=f"{stack.base}/v1", api_key=token(alice), max_retries=0, timeout=60)

    # When the official client streams a call that asks for a tool
    pieces, arrived, finish, completion_id = [], [], None, None
    for chunk in client.chat.completions.create(model="m", messages=USER, tools=WEATHER, stream=True):
        completion_id = chunk.id
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or ():
                pieces.append(piece)
                arrived.append(time.time())
    job = Job.objects.get(pk=int(completion_id.removeprefix("chatcmpl-")))

    # Then the pieces came while the job ran, the call announced first, its arguments in pieces
    assert job.status == "done" and finish == "tool_calls"
    assert arrived and arrived[0] < job.finished_at.timestamp(), "the call was announced while the model wrote it"
    assert len([p for p in pieces if p.function and p.function.arguments]) > 1, "arguments in pieces, not whole"
    assert arrived[-2] < job.finished_at.timestamp(), "more than the announcement came before the end"
    assert pieces[0].id and pieces[0].function.name == "weather"
    # ... and the assembled call is the one a plain (not streamed) call returns
    plain = client.chat.completions.create(model="m", messages=USER, tools=WEATHER)
    assert plain.choices[0].finish_reason == "tool_calls"
    expected = [call.model_dump(exclude_none=True) for call in plain.choices[0].message.tool_calls]
    assert assembled(pieces) == expected
    assert json.loads(expected[0]["function"]["arguments"]) == {"city": "Paris, in the rain"}
