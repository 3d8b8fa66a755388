"""OpenAI's request checks, response shapes and error mapping; the relay's bookkeeping of deltas."""

import random
from datetime import timedelta

import pytest
from django.utils import timezone

from scheduler.gateway import shapes
from scheduler.gateway.feed import Delta, Relay
from telemachus import errors

HELLO = [{"role": "user", "content": "hello there"}]


class TestChatCall:
    def test_options_pass_through_and_the_estimate_counts_prompt_and_completion(self):
        call = shapes.chat_call(
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
        assert shapes.chat_call({"model": "m", "messages": HELLO}).est_tokens == 6 + 256
        assert shapes.chat_call({"model": "big", "messages": HELLO}).est_tokens == 6 + 4000

    def test_a_tool_conversation_is_accepted(self):
        call = shapes.chat_call(
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
        with pytest.raises(shapes.OpenAIError) as caught:
            shapes.chat_call(body)
        assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize(
    "raw",
    [
        b"{nope",
        b'{"model": "m", "stop": Infinity}',
        b'{"temperature": NaN}',
        b'{"model": "m", "messages": [{"role": "user", "content": "a\\u0000b"}]}',
        b'{"model\\u0000": "m"}',
    ],
)
def test_bodies_the_database_could_not_store_are_refused(raw):
    with pytest.raises(shapes.OpenAIError) as caught:
        shapes.parse_body(raw)
    assert caught.value.status == 400


class TestEmbeddingsCall:
    @pytest.mark.parametrize("value, est", [("one two", 2), (["a b", "c"], 3), ([1, 2, 3], 3), ([[1, 2], [3]], 3)])
    def test_inputs(self, value, est):
        call = shapes.embeddings_call({"model": "e", "input": value, "dimensions": 8, "encoding_format": "base64"})
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
        with pytest.raises(shapes.OpenAIError):
            shapes.embeddings_call(body)


class TestErrors:
    def test_domain_errors_in_openai_shape(self):
        unknown = shapes.from_domain(errors.UnknownModel("no such model", model="x"))
        assert (unknown.status, unknown.code, unknown.param) == (404, "model_not_found", "model")
        assert unknown.body() == {
            "error": {
                "message": "no such model",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        later = shapes.from_domain(errors.TryLater("queue full", retry_after=7))
        assert (later.status, later.code, later.headers) == (429, "try_later", {"retry-after": "7"})
        invalid = shapes.from_domain(errors.ValidationFailed({"priority": ["At most 5."]}))
        assert (invalid.status, invalid.param, invalid.message) == (400, "priority", "priority: At most 5.")

    def test_a_budget_that_resets_soon_may_be_retried_and_one_that_resets_later_may_not(self):
        soon = timezone.now() + timedelta(seconds=30)
        later = timezone.now() + timedelta(hours=5)
        retry = shapes.from_domain(errors.QuotaExceeded("spent", reset_at=soon.isoformat()))
        wait = shapes.from_domain(errors.QuotaExceeded("spent", reset_at=later.isoformat()))
        assert (
            retry.status == 429
            and 25 <= int(retry.headers["retry-after"]) <= 31
            and "x-should-retry" not in retry.headers
        )
        assert int(wait.headers["retry-after"]) > 3600 and wait.headers["x-should-retry"] == "false"

    @pytest.mark.parametrize(
        "status, upstream, timed_out, expected",
        [
            ("failed", 502, False, (502, "executor_error")),
            ("failed", None, True, (504, "executor_timeout")),
            ("failed", 504, False, (504, "executor_timeout")),
            ("failed", 400, False, (400, "model_server_rejected")),
            ("failed", 429, False, (502, "executor_error")),
            ("canceled", None, False, (409, "job_canceled")),
        ],
    )
    def test_how_a_job_that_did_not_answer_is_told(self, status, upstream, timed_out, expected):
        failure = shapes.failure(status=status, error="boom", upstream_status=upstream, timed_out=timed_out)
        assert (failure.status, failure.code) == expected and failure.headers["x-should-retry"] == "false"


class TestRelay:
    def test_in_order_deltas_pass_and_repeats_are_dropped(self):
        relay = Relay(exact=True)
        assert [d.text for d in relay.accept([Delta(1, 0, "ab"), Delta(1, 2, "cd"), Delta(1, 2, "cd")])] == ["ab", "cd"]
        assert [d.text for d in relay.accept([Delta(1, 3, "de")])] == ["e"], "the overlap is dropped"
        assert relay.rest({"message": {"content": "abcdefg"}}) == "fg"

    def test_after_a_gap_the_rest_comes_from_the_result(self):
        relay = Relay(exact=True)
        relay.accept([Delta(1, 0, "ab")])
        assert relay.accept([Delta(1, 4, "ef"), Delta(1, 6, "g")]) == [] and relay.gap
        assert relay.rest({"message": {"content": "abcdefg"}}) == "cdefg"

    def test_an_exact_relay_breaks_on_a_retry_after_text_went_out(self):
        relay = Relay(exact=True)
        relay.accept([Delta(1, 0, "partial")])
        assert relay.accept([Delta(2, 0, "other")]) == [] and relay.broken
        assert relay.rest({"message": {"content": "other answer"}}) is None

    def test_an_exact_relay_follows_a_retry_when_nothing_went_out_yet(self):
        relay = Relay(exact=True)
        assert [d.text for d in relay.accept([Delta(2, 0, "fresh")])] == ["fresh"] and not relay.broken

    def test_a_loose_relay_joins_late_and_starts_over_with_each_attempt(self):
        relay = Relay(exact=False)
        assert relay.accept([Delta(1, 5, "fgh")]) == [Delta(1, 5, "fgh")]
        assert relay.rest({"message": {"content": "abcdefghij"}}) == "ij"
        assert relay.accept([Delta(2, 0, "new")]) == [Delta(2, 0, "new")] and not relay.broken


def test_any_json_body_is_either_accepted_or_a_400():
    """Bodies built at random from JSON values under the request's own keys: never anything but a
    ModelCall or an OpenAIError (a 500 would be a crash)."""
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
        for parse in (shapes.chat_call, shapes.embeddings_call):
            try:
                parse(body)
            except shapes.OpenAIError as exc:
                assert exc.status == 400
