"""OpenAI's request checks (scheduler/gateway/openai/request.py): what a chat completions or
embeddings body may say, and the chat job it becomes."""

import random

import pytest

from scheduler.gateway.errors import GatewayError
from scheduler.gateway.openai.request import chat_call, embeddings_call

HELLO = [{"role": "user", "content": "hello there"}]


class TestChatCall:
    def test_options_pass_through_and_the_estimate_counts_prompt_and_completion(self):
        call = chat_call(
            {
                "model": "m",
                "messages": HELLO,
                "max_completion_tokens": 20,
                "temperature": 0.5,
                "seed": 7,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "auto",
                "stream": True,
                "stream_options": {"include_usage": True},
                "service_tier": "flex",
                "metadata": {"x": 1},
            }
        )
        assert call.input == {
            "messages": HELLO,
            "max_tokens": 20,
            "temperature": 0.5,
            "seed": 7,
            "stream": True,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto",
        }, "max_completion_tokens becomes max_tokens; options model servers do not share are dropped"
        assert (call.est_tokens, call.stream, call.include_usage) == (6 + 20, True, True)

    def test_without_max_tokens_the_estimate_assumes_a_default_completion(self, settings):
        settings.TELEMACHUS_COMPLETION_ESTIMATE, settings.TELEMACHUS_COMPLETION_ESTIMATES = 256, {"big": 4000}
        assert chat_call({"model": "m", "messages": HELLO}).est_tokens == 6 + 256
        assert chat_call({"model": "big", "messages": HELLO}).est_tokens == 6 + 4000

    def test_a_tool_conversation_is_accepted(self):
        call = chat_call(
            {
                "model": "m",
                "messages": [
                    *HELLO,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "tool", "tool_call_id": "c1", "content": "42"},
                ],
            }
        )
        sent = call.input["messages"]
        assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
        assert sent[1]["tool_calls"][0]["function"]["name"] == "f" and sent[2]["tool_call_id"] == "c1"

    @pytest.mark.parametrize(
        "body, param",
        [
            ([], None),
            ({"model": "", "messages": HELLO}, "model"),
            ({"model": "m" * 201, "messages": HELLO}, "model"),
            ({"model": "m", "messages": "hi"}, "messages"),
            ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
            ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
            ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
            ({"model": "m", "messages": HELLO, "stream": "yes"}, "stream"),
            ({"model": "m", "messages": HELLO, "max_tokens": 0}, "max_tokens"),
            ({"model": "m", "messages": HELLO, "max_tokens": True}, "max_tokens"),
            ({"model": "m", "messages": HELLO, "top_p": 1.5}, "top_p"),
            ({"model": "m", "messages": HELLO, "temperature": float("nan")}, "temperature"),
            ({"model": "m", "messages": HELLO, "tools": {"f": 1}}, "tools"),
            ({"model": "m", "messages": HELLO, "tool_choice": "always"}, "tool_choice"),
            ({"model": "m", "messages": HELLO, "tool_choice": {"function": 5}}, "tool_choice"),
            ({"model": "m", "messages": HELLO, "tools": [{"function": {"name": "f"}}, 5]}, "tools[1]"),
            ({"model": "m", "messages": HELLO, "max_tokens": 10**30}, "max_tokens"),
            ({"model": "m", "messages": HELLO, "seed": 10**30}, "seed"),
        ],
    )
    def test_bad_bodies(self, body, param):
        with pytest.raises(GatewayError) as caught:
            chat_call(body)
        assert caught.value.status == 400 and caught.value.param == param


class TestEmbeddingsCall:
    @pytest.mark.parametrize("value, est", [("one two", 2), (["a b", "c"], 3), ([1, 2, 3], 3), ([[1, 2], [3]], 3)])
    def test_inputs(self, value, est):
        call = embeddings_call({"model": "e", "input": value, "dimensions": 8, "encoding_format": "base64"})
        assert call.api == "embeddings" and call.est_tokens == est
        assert call.input == {"input": value, "dimensions": 8, "encoding_format": "base64"}

    @pytest.mark.parametrize(
        "body",
        [
            {"model": "e"},
            {"model": "e", "input": ""},
            {"model": "e", "input": []},
            {"model": "e", "input": ["a", ""]},
            {"model": "e", "input": [None]},
            {"model": "e", "input": [{"a": 1}]},
            {"model": "e", "input": [[1, "a"]]},
            {"model": "e", "input": [True]},
            {"model": "e", "input": 5},
            {"model": "e", "input": "a", "dimensions": 0},
            {"model": "e", "input": "a", "dimensions": 10**9},
            {"model": "e", "input": "a", "encoding_format": "hex"},
        ],
    )
    def test_bad_bodies(self, body):
        with pytest.raises(GatewayError):
            embeddings_call(body)


def test_any_json_body_is_either_accepted_or_a_400():
    """Bodies built at random from JSON values under the request's own keys: never anything but a
    ModelCall or a GatewayError (a 500 would be a crash)."""
    rng = random.Random(20261203)
    keys = [
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "tools",
        "tool_choice",
        "seed",
        "stop",
        "input",
        "dimensions",
        "encoding_format",
        "role",
        "content",
        "function",
        "name",
        "tool_call_id",
        "include_usage",
        "type",
    ]

    def value(depth: int = 0):
        kinds = ["none", "bool", "int", "float", "str"] + (["list", "dict"] if depth < 3 else [])
        kind = rng.choice(kinds)
        if kind == "none":
            return None
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "int":
            return rng.choice([0, 1, -1, 2, 10**20, rng.randint(-5, 5)])
        if kind == "float":
            return rng.choice([0.5, -3.0, 1e308, float("inf")])
        if kind == "str":
            return rng.choice(["", "m", "user", "tool", "auto", "none", "function", "x" * 300, "base64"])
        if kind == "list":
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(3000):
        body = {key: value() for key in rng.sample(keys, rng.randint(0, 8))}
        if rng.random() < 0.5:
            body["messages"] = [{"role": rng.choice(["user", "tool", "assistant"]), "content": value(2)}]
        for parse in (chat_call, embeddings_call):
            try:
                parse(body)
            except GatewayError as exc:
                assert exc.status == 400
