"""The Messages translator (scheduler/gateway/anthropic/) on its own: what maps to chat
completions, what is refused (naming the field), the error shape, and that what it answers parses
as the official SDK's types."""

# ruff: noqa: E501 (tables of requests, one case a line)

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared.error_response import ErrorResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from scheduler.gateway import anthropic
from scheduler.gateway.asgi import Request
from scheduler.gateway.errors import GatewayError

EVENT = TypeAdapter(RawMessageStreamEvent)
TOOL = {"name": "weather", "description": "d", "input_schema": {"type": "object"}}


def translate(**body):
    return anthropic.translate({"model": "m", "max_tokens": 16, **body})


class TestRequests:
    def test_system_messages_and_options(self):
        call = translate(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "hi"}],
            stop_sequences=["END"],
            temperature=0.3,
            metadata={"user_id": "u1"},
            service_tier="auto",
            thinking={"type": "disabled"},
        )  # fmt: skip
        assert call.input == {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "max_tokens": 16,
            "temperature": 0.3,
            "stop": ["END"],
            "user": "u1",
        }
        assert call.context == {"prompt": 4 + 2 + 4 + 1} and call.est_tokens == 11 + 16

    def test_blocks_tools_and_results(self):
        call = translate(
            messages=[
                {"role": "user", "content": [
                    {"type": "text", "text": "What is this? "},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                ]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
                    {"type": "tool_use", "id": "t2", "name": "weather", "input": {}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "cold"}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "timeout", "is_error": True},
                    {"type": "text", "text": "And now?"},
                ]},
            ],
            tools=[TOOL],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )  # fmt: skip
        assert call.input["messages"] == [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this? "},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
                    {"id": "t2", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "cold"},
            {"role": "tool", "tool_call_id": "t2", "content": "[tool error] timeout"},
            {"role": "user", "content": "And now?"},
        ]
        assert call.input["tools"] == [
            {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "description": "d"}}
        ]
        assert call.input["tool_choice"] == "required" and call.input["parallel_tool_calls"] is False

    @pytest.mark.parametrize(
        "choice, expected",
        [({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
         ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}})],
    )  # fmt: skip
    def test_tool_choices(self, choice, expected):
        call = translate(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice=choice)
        assert call.input["tool_choice"] == expected and "parallel_tool_calls" not in call.input

    def test_structured_output(self):
        call = translate(
            messages=[{"role": "user", "content": "hi"}],
            output_config={"format": {"type": "json_schema", "schema": {}}},
        )
        assert call.input["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": {}}}

    def test_count_tokens_needs_no_max_tokens(self):
        call = anthropic.translate({"model": "m", "messages": [{"role": "user", "content": "a b c"}]}, counting=True)
        assert call.context["prompt"] == 7
        with pytest.raises(GatewayError) as caught:
            anthropic.translate({"model": "m", "messages": [{"role": "user", "content": "a"}]})
        assert caught.value.param == "max_tokens"

    @pytest.mark.parametrize(
        "body, param",
        [
            ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
            ({"top_k": 3}, "top_k"),
            ({"container": "c1"}, "container"),
            ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
            ({"output_config": {"effort": "high"}}, "output_config.effort"),
            ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
            ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
            ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
            ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
            ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
            ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}, "messages[0].content[0].source"),
            ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": "s"}]}]}, "messages[0].content[0].type"),
            ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}, "messages[0].content[0].content[0].type"),
            ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": "x"}]}]}, "messages[0].content[0].input"),
            ({"messages": []}, "messages"),
            ({"system": 5}, "system"),
            ({"stop_sequences": "END"}, "stop_sequences"),
            ({"metadata": {"tags": ["x"]}}, "metadata"),
            ({"max_tokens": 0}, "max_tokens"),
        ],
    )  # fmt: skip
    def test_refusals_name_the_field(self, body, param):
        with pytest.raises(GatewayError) as caught:
            translate(**{"messages": [{"role": "user", "content": "hi"}], **body})
        assert (caught.value.status, caught.value.param) == (400, param)
        assert param.split("[")[0].split(".")[0] in caught.value.message


class TestErrors:
    @pytest.mark.parametrize(
        "status, kind",
        [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
         (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"), (409, "conflict_error"),
         (500, "api_error"), (502, "api_error"), (504, "timeout_error")],
    )  # fmt: skip
    def test_the_shape_and_type_of_each_status(self, status, kind):
        body = anthropic.MESSAGES.error_body(GatewayError(status, "why", code="our_code", param="p"))
        assert body == {"type": "error", "error": {"type": kind, "message": "why", "code": "our_code", "param": "p"}}
        if kind != "request_too_large" and kind != "conflict_error":
            assert ErrorResponse.model_validate(body).error.type == kind

    def test_an_error_in_a_stream_is_an_error_event(self):
        name, data = _event(anthropic.MESSAGES.late_error(GatewayError(504, "slow", code="timeout")))
        assert name == "error" and data["error"]["type"] == "timeout_error"

    def test_x_api_key_or_bearer(self):
        def request(*headers):
            return Request({"method": "POST", "path": "/v1/messages", "headers": list(headers)}, b"")

        assert anthropic.MESSAGES.authorization(request((b"x-api-key", b"k1"))) == "Bearer k1"
        assert anthropic.MESSAGES.authorization(request((b"authorization", b"Bearer k2"))) == "Bearer k2"
        assert anthropic.MESSAGES.authorization(request()) is None

    def test_tool_arguments_that_are_not_an_object_are_a_model_failure(self):
        result = {"message": {"tool_calls": [{"id": "t", "function": {"name": "w", "arguments": "[1"}}]}}
        with pytest.raises(GatewayError) as caught:
            anthropic.MESSAGES.answer(job_id=1, created=0, call=_call(), result=result)
        assert (caught.value.status, caught.value.code) == (502, "invalid_tool_call")


RESULT = {
    "model": "m",
    "message": {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"a": 1}'}}],
    },
    "finish_reason": "tool_calls",
    "usage": {"prompt_tokens": 7, "completion_tokens": 3},
}


def _call():
    return translate(messages=[{"role": "user", "content": "hi"}])


class TestAnswers:
    def test_a_message_parses_as_the_sdks_message(self):
        parsed = Message.model_validate(anthropic.MESSAGES.answer(job_id=9, created=0, call=_call(), result=RESULT))
        assert parsed.id == "msg_9" and parsed.stop_reason == "tool_use"
        assert [block.type for block in parsed.content] == ["text", "tool_use"]
        assert parsed.content[1].input == {"a": 1} and parsed.content[1].id == "call_1"
        assert (parsed.usage.input_tokens, parsed.usage.output_tokens) == (7, 3)

    @pytest.mark.parametrize(
        "finish, stop",
        [("stop", "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal"), (None, "end_turn")],
    )
    def test_stop_reasons(self, finish, stop):
        result = {"message": {"content": "x"}, "finish_reason": finish}
        assert anthropic.MESSAGES.answer(job_id=1, created=0, call=_call(), result=result)["stop_reason"] == stop

    def test_a_stream_is_the_sdks_events(self):
        writer = anthropic.MESSAGES.writer(job_id=9, created=0, call=_call())
        raw = writer.opening("Check") + writer.text("ing") + writer.closing(RESULT, ".")
        events = [_event(block) for block in raw.decode().strip().split("\n\n")]
        parsed = [EVENT.validate_python(data) for name, data in events if name != "ping"]
        assert [name for name, _ in events if name != "ping"] == [e.type for e in parsed]
        assert [e.type for e in parsed] == [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert "".join(e.delta.text for e in parsed[2:5]) == "Checking."
        assert parsed[6].index == 1 and parsed[6].content_block.name == "weather"
        assert json.loads(parsed[7].delta.partial_json) == {"a": 1}
        assert parsed[9].delta.stop_reason == "tool_use" and parsed[9].usage.output_tokens == 3


def _event(block: bytes | str) -> tuple[str, dict]:
    text = block.decode() if isinstance(block, bytes) else block
    head, data = text.strip().split("\n", 1)
    return head.removeprefix("event: "), json.loads(data.removeprefix("data: "))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
FIELDS = st.sampled_from(["messages", "system", "tools", "tool_choice", "stop_sequences", "metadata", "output_config"])
BLOCKS = st.dictionaries(
    st.sampled_from(["type", "text", "id", "name", "input", "tool_use_id", "content", "source", "is_error"]),
    JSON | st.sampled_from(["text", "tool_use", "tool_result", "image", "base64"]),
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": st.lists(BLOCKS, max_size=3) | JSON}
    ),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(FIELDS, JSON | MESSAGES, max_size=4))
def test_any_body_is_translated_or_refused_never_a_crash(body):
    """Whatever JSON arrives, the translator answers with a job or a 400, never a server error."""
    try:
        call = anthropic.translate(
            {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **body}
        )
    except GatewayError as exc:
        assert exc.status == 400 and exc.message
    else:
        assert call.input["messages"]
