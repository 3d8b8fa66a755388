"""Streamed tool calls between the feed and the protocols' writers: the relay's pieces of each
call in order (scheduler/notify/feed.py), and each writer finishing what it relayed from the
job's result, or refusing to when the result does not continue it."""

# ruff: noqa: E501 (a table of calls, one a line)

import json

import pytest

from scheduler.gateway import anthropic, openai, responses
from scheduler.gateway.errors import INTERRUPTED, GatewayError
from scheduler.gateway.openai.request import chat_call
from scheduler.gateway.relay import Relay, ToolPiece
from scheduler.notify.feed import Delta


def tool(offset: int, text: str, *, index: int = 0, attempt: int = 1, ident: str = "c1", name: str = "w") -> Delta:
    return Delta(attempt, offset, text, f"tool:{index}", ident, name)


class TestRelay:
    def test_a_call_is_announced_once_its_id_and_name_are_known_then_its_pieces_in_order(self):
        relay = Relay(exact=True)
        assert relay.accept([tool(0, '{"a"', ident="", name="")]) == [] and relay.take_tools() == []
        relay.accept([tool(4, ": 1", name=""), tool(4, ": 1"), Delta(1, 0, "hi")])
        assert relay.take_tools() == [ToolPiece(0, "c1", "w", '{"a": 1', first=True)]
        relay.accept([tool(6, "1}"), tool(7, "}"), tool(0, '{"a": 1}', index=1, ident="c2")])
        assert relay.take_tools() == [
            ToolPiece(0, "c1", "w", "}", first=False),
            ToolPiece(1, "c2", "w", '{"a": 1}', first=True),
        ]

    def test_a_gap_stops_that_call_only(self):
        relay = Relay(exact=True)
        relay.accept([tool(0, "{"), tool(5, "x"), tool(0, "[", index=1, ident="c2")])
        relay.accept([tool(1, "}"), tool(1, "]", index=1, ident="c2")])
        assert [(p.index, p.text) for p in relay.take_tools()] == [(0, "{"), (1, "["), (1, "]")]
        assert relay.tools[0].gap and not relay.tools[1].gap

    def test_a_retry_after_a_call_went_out_breaks_the_relay(self):
        relay = Relay(exact=True)
        relay.accept([tool(0, "{")])
        relay.accept([tool(0, "[", attempt=2)])
        assert relay.broken

    def test_a_loose_relay_ignores_tool_calls(self):
        relay = Relay(exact=False)
        assert relay.accept([tool(0, "{"), Delta(1, 0, "hi")]) == [Delta(1, 0, "hi")] and relay.take_tools() == []


RESULT = {
    "message": {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}],
    },
    "finish_reason": "tool_calls",
}


def events(raw: bytes) -> list[dict]:
    return [
        json.loads(block.split("data: ", 1)[1]) for block in raw.decode().strip().split("\n\n") if "data: {" in block
    ]


@pytest.mark.parametrize(
    "dialect, call",
    [
        (openai.CHAT, chat_call({"model": "m", "messages": [{"role": "user", "content": "x"}]})),
        (responses.RESPONSES, responses.translate({"model": "m", "input": "x"})),
        (anthropic.MESSAGES, anthropic.translate({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})),
    ],
    ids=["chat", "responses", "messages"],
)  # fmt: skip
class TestWriters:
    def test_the_rest_of_a_relayed_call_comes_from_the_result(self, dialect, call):
        writer = dialect.writer(job_id=1, created=0, call=call)
        raw = writer.opening("") + writer.tool(ToolPiece(0, "c1", "w", '{"a', first=True))
        raw += writer.closing(RESULT, "")
        sent = "".join(_arguments(event) for event in events(raw))
        assert sent == '{"a": 1}', "the relayed start and the rest, once each"

    def test_a_result_that_does_not_continue_the_relayed_call_ends_the_stream(self, dialect, call):
        writer = dialect.writer(job_id=1, created=0, call=call)
        writer.opening("")
        writer.tool(ToolPiece(0, "c1", "w", '{"b', first=True))
        with pytest.raises(GatewayError) as caught:
            writer.closing(RESULT, "")
        assert caught.value is INTERRUPTED


def _arguments(event: dict) -> str:
    """The arguments text an event carries, in any of the three protocols."""
    if event.get("object") == "chat.completion.chunk":
        calls = event["choices"][0]["delta"].get("tool_calls") or [] if event["choices"] else []
        return "".join(c["function"].get("arguments") or "" for c in calls)
    if event.get("type") == "response.function_call_arguments.delta":
        return event["delta"]
    if event.get("type") == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
        return event["delta"]["partial_json"]
    return ""


def test_messages_text_after_a_tool_block_is_a_new_block_and_a_late_piece_ends_the_stream():
    call = anthropic.translate({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
    writer = anthropic.MESSAGES.writer(job_id=1, created=0, call=call)
    raw = writer.opening("") + writer.tool(ToolPiece(0, "c1", "w", '{"a', first=True)) + writer.text("hm")
    starts = [e for e in events(raw) if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "tool_use"), (1, "text")]
    assert writer.tool(ToolPiece(0, "c1", "w", '": 1}', first=False)) == b"", "block 0 is closed"
    with pytest.raises(GatewayError) as caught:
        writer.closing({**RESULT, "message": {**RESULT["message"], "content": "hm"}}, "")
    assert caught.value is INTERRUPTED
