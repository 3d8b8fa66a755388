"""The Responses translator (scheduler/gateway/responses/) on its own: what maps to chat
completions, what is refused (naming the field), and that what it answers parses as the official
SDK's types."""

# ruff: noqa: E501 (tables of requests, one case a line)

import json
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent

from scheduler.gateway import responses
from scheduler.gateway.errors import GatewayError

# Each event type's own model, so a failed check says what is wrong with that event.
EVENTS = {cls.model_fields["type"].annotation.__args__[0]: cls for cls in get_args(get_args(ResponseStreamEvent)[0])}
TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}, "strict": True}


def translate(**body):
    return responses.translate({"model": "m", **body})


class TestRequests:
    def test_a_string_input_and_instructions(self):
        call = translate(input="hi", instructions="Be brief.", max_output_tokens=5, temperature=0.2, top_p=0.9)
        assert call.input == {
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0.2,
            "top_p": 0.9,
        }
        assert call.est_tokens == 4 + 2 + 4 + 1 + 5 and not call.stream

    def test_items(self):
        call = translate(
            input=[
                {"role": "developer", "content": "Rules."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Look: "},
                        {"type": "input_image", "image_url": "https://x/cat.png", "detail": "low"},
                    ],
                },
                {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"a": 1}', "id": "fc_1"},
                {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
                {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
            ],
            stream=True,
        )  # fmt: skip
        assert call.input["messages"] == [
            {"role": "system", "content": "Rules."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "low"}},
                ],
            },
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"a": 1}'}},
                    {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "rain"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
            },
        ]
        assert call.stream and call.input["stream"] is True

    def test_tools_choice_and_format(self):
        call = translate(
            input="hi",
            tools=[TOOL],
            tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
            user="u1",
        )
        assert call.input["tools"] == [
            {
                "type": "function",
                "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}, "strict": True},
            }
        ]
        assert call.input["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
        assert call.input["parallel_tool_calls"] is False and call.input["user"] == "u1"
        assert call.input["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
        }

    @pytest.mark.parametrize(
        "accepted",
        [
            {"store": False},
            {"include": []},
            {"truncation": "disabled"},
            {"background": False},
            {"service_tier": "auto"},
            {"reasoning": {"effort": None, "summary": None}},
            {"prompt_cache_key": "k", "safety_identifier": "s", "stream_options": {"include_obfuscation": False}},
            {"metadata": {"app": "x"}},
            {"text": {"format": {"type": "text"}}},
        ],
    )
    def test_defaults_and_hints_are_accepted(self, accepted):
        assert translate(input="hi", **accepted).input["messages"] == [{"role": "user", "content": "hi"}]

    @pytest.mark.parametrize(
        "body, param",
        [
            ({"previous_response_id": "resp_1"}, "previous_response_id"),
            ({"conversation": {"id": "c"}}, "conversation"),
            ({"store": True}, "store"),
            ({"include": ["message.output_text.logprobs"]}, "include"),
            ({"truncation": "auto"}, "truncation"),
            ({"background": True}, "background"),
            ({"service_tier": "flex"}, "service_tier"),
            ({"reasoning": {"effort": "low"}}, "reasoning"),
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"max_tool_calls": 2}, "max_tool_calls"),
            ({"prompt": {"id": "p"}}, "prompt"),
            ({"text": {"verbosity": "low"}}, "text.verbosity"),
            ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
            ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
            ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input[0].type"),
            ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0].file_id"),
            ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]}, "input[0].output[0]"),
            ({"input": []}, "input"),
            ({"max_output_tokens": 0}, "max_output_tokens"),
            ({"temperature": 3}, "temperature"),
        ],
    )  # fmt: skip
    def test_refusals_name_the_field(self, body, param):
        with pytest.raises(GatewayError) as caught:
            translate(**{"input": "hi", **body})
        assert (caught.value.status, caught.value.param) == (400, param)
        assert param.split("[")[0].split(".")[0] in caught.value.message or param in caught.value.message

    def test_previous_response_id_says_why(self):
        with pytest.raises(GatewayError) as caught:
            translate(input="hi", previous_response_id="resp_1")
        assert "not kept" in caught.value.message and caught.value.code == "unsupported_parameter"


RESULT = {
    "model": "m",
    "message": {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
    },
    "finish_reason": "tool_calls",
    "usage": {"prompt_tokens": 7, "completion_tokens": 3},
}


class TestAnswers:
    def test_a_response_parses_as_the_sdks_response(self):
        call = translate(input="hi", tools=[TOOL], metadata={"app": "x"})
        body = responses.RESPONSES.answer(job_id=42, created=1700000000, call=call, result=RESULT)
        parsed = Response.model_validate(body)
        assert parsed.id == "resp_42" and parsed.status == "completed" and parsed.output_text == "Checking."
        assert [item.type for item in parsed.output] == ["message", "function_call"]
        assert parsed.output[1].call_id == "call_1" and parsed.usage.total_tokens == 10
        assert parsed.tools[0].name == "weather" and parsed.metadata == {"app": "x"} and parsed.store is False

    def test_a_reply_cut_by_the_token_limit_is_incomplete(self):
        result = {"message": {"role": "assistant", "content": "sim0"}, "finish_reason": "length"}
        body = responses.RESPONSES.answer(job_id=1, created=0, call=translate(input="hi"), result=result)
        assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert body["output"][0]["status"] == "incomplete"

    def test_a_stream_is_the_sdks_events_numbered_in_order(self):
        writer = responses.RESPONSES.writer(job_id=42, created=0, call=translate(input="hi", tools=[TOOL]))
        raw = writer.opening("Check") + writer.text("ing") + writer.closing(RESULT, ".")
        events = [_event(block) for block in raw.decode().strip().split("\n\n")]
        parsed = [EVENTS[data["type"]].model_validate(data) for _, data in events]
        assert [name for name, _ in events] == [e.type for e in parsed]
        assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
        assert [e.type for e in parsed] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert parsed[7].text == "Checking." and parsed[10].output_index == 1
        assert parsed[-1].response.output[1].arguments == "{}"

    def test_a_failure_is_response_failed(self):
        writer = responses.RESPONSES.writer(job_id=42, created=0, call=translate(input="hi"))
        writer.opening("")
        name, data = _event(writer.failure(GatewayError(502, "upstream says 502", code="executor_error")))
        failed = EVENTS[data["type"]].model_validate(data)
        assert name == failed.type == "response.failed" and failed.response.error.code == "server_error"
        assert failed.response.error.message == "upstream says 502 (executor_error)"


def _event(block: bytes | str) -> tuple[str, dict]:
    text = block.decode() if isinstance(block, bytes) else block
    head, data = text.strip().split("\n", 1)
    return head.removeprefix("event: "), json.loads(data.removeprefix("data: "))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
FIELDS = st.sampled_from(["input", "instructions", "tools", "tool_choice", "text", "metadata", "max_output_tokens"])
ITEMS = st.dictionaries(
    st.sampled_from(["type", "role", "content", "call_id", "name", "arguments", "output"]),
    JSON | st.sampled_from(["message", "function_call", "function_call_output", "user", "assistant", "input_text"]),
)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(FIELDS, JSON | st.lists(ITEMS, max_size=3), max_size=4))
def test_any_body_is_translated_or_refused_never_a_crash(body):
    """Whatever JSON arrives, the translator answers with a job or a 400, never a server error."""
    try:
        call = translate(**body)
    except GatewayError as exc:
        assert exc.status == 400 and exc.message
    else:
        assert call.input["messages"]
