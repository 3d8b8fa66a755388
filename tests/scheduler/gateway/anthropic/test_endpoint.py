"""Anthropic's Messages API as apps use it: the official `anthropic` package against the API server, real
workers and a real model server that speaks chat completions. Every call is a governed `chat` job
under the team's caps; errors come in Anthropic's shape."""

import json
import socket
import threading

import anthropic
import httpx
import pytest
from anthropic import Anthropic

from quotas.models import Usage
from quotas.services import quota_policy_create
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.policy import queue_policy_update
from telemachus.control.features import feature_set
from telemachus.models import Team
from tests.processes import wait_until
from tests.scheduler.gateway.conftest import live_deltas, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "hello there"}]
WEATHER = [
    {
        "name": "weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def sdk(stack, user, **options) -> Anthropic:
    options.setdefault("max_retries", 0)
    options.setdefault("timeout", 60)
    return Anthropic(base_url=stack.base, api_key=token(user), **options)


def job_of(message_id: str) -> Job:
    return Job.objects.get(pk=int(message_id.removeprefix("msg_")))


def cap_team_a(limit: int) -> None:
    quota_policy_create(scope="team", subject="a", dimension="ai.concurrency", limit=limit)


def test_plain(stack, alice):
    executor = stack.executor(stack.simllm)
    cap_team_a(1)
    quota_policy_create(scope="team", subject="a", dimension="ai.tokens", limit=10_000, window="day")
    reply = sdk(stack, alice).messages.create(
        model="m",
        max_tokens=4,
        system=[{"type": "text", "text": "Be brief."}],
        messages=HELLO,
        stop_sequences=["never"],
        extra_body={"temperature": 0.5},  # older SDKs send it; this one no longer knows it
    )
    assert (reply.type, reply.role, reply.model) == ("message", "assistant", "m")
    assert [block.text for block in reply.content] == ["[simulated by simllm] sim0 sim1 sim2 sim3"]
    assert reply.stop_reason == "max_tokens"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (12, 4)
    job = job_of(reply.id)
    assert (job.status, job.type, job.team.slug, job.meta) == ("done", "chat", "a", {"via": "anthropic"})
    assert job.input == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "temperature": 0.5,
        "stop": ["never"],
    }
    assert [e.event for e in JobEvent.objects.filter(job=job).order_by("id")][-1] == "finished"
    assert stack.stats(executor)["requests"] == 1
    # Billed like any chat job, and visible in the job API with its events
    assert job.tokens_used == 16 and Usage.objects.get(scope="team", subject="a").tokens == 16
    listed = httpx.get(f"{stack.base}/api/jobs/{job.pk}/events/", headers={"Authorization": f"Token {token(alice)}"})
    events = listed.json()
    events = events.get("results", events) if isinstance(events, dict) else events
    assert listed.status_code == 200 and [e["event"] for e in events][-1] == "finished"


def test_the_team_header_picks_the_team(stack, alice, make_team):
    make_team("c", {alice: "member"})
    stack.executor(stack.simllm)
    with pytest.raises(anthropic.BadRequestError) as ambiguous:
        sdk(stack, alice).messages.create(model="m", max_tokens=2, messages=HELLO)
    assert ambiguous.value.body["error"]["code"] == "team_required"
    reply = sdk(stack, alice, default_headers={"X-Telemachus-Team": "c"}).messages.create(
        model="m", max_tokens=2, messages=HELLO
    )
    assert job_of(reply.id).team.slug == "c"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_cancels_its_job(stack, alice, stream):
    executor = stack.executor(stack.slow)
    body = json.dumps({"model": "m", "max_tokens": 64, "messages": HELLO, "stream": stream}).encode()
    host, port = stack.base.removeprefix("http://").split(":")
    # Given a call whose model takes 5 s, running at the model server
    client = socket.create_connection((host, int(port)))
    client.sendall(
        b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"x-api-key: {token(alice)}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: stack.stats(executor).get("in_flight") == 1, timeout=30, what="the model call to start")
    # When the client hangs up
    client.close()
    # Then its job is canceled, saying why, its slot freed and the model server's request aborted
    wait_until(lambda: Job.objects.get().status == "canceled", timeout=30, what="the job to be canceled")
    assert Job.objects.get().error == "client disconnected" and not Slot.objects.exists()
    wait_until(lambda: stack.stats(executor).get("disconnects") == 1, timeout=30, what="the request aborted")


def test_streamed(stack, alice):
    executor = stack.executor(stack.trickle)
    cap_team_a(1)
    kinds, texts = [], []
    with sdk(stack, alice).messages.stream(model="m", max_tokens=64, messages=HELLO) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                texts.append(event.text)
        final = stream.get_final_message()
    expected = "[simulated by simllm] " + " ".join(f"sim{i}" for i in range(8))
    assert "".join(texts) == final.content[0].text == expected == Job.objects.get().result["message"]["content"]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 8 and final.usage.input_tokens == 6
    assert stack.stats(executor)["requests"] == 1
    if live_deltas():
        # Relayed only at the end, the text would come as one piece: in pieces, it came as written
        # (test_live_protocol_streams.py times a stream against the job's end, without an SDK's costs)
        assert len(texts) > 2


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(stack, alice, stream):
    stack.executor(stack.simllm)
    cap_team_a(1)
    client = sdk(stack, alice)
    messages: list = [{"role": "user", "content": "Paris"}]
    # The model asks for a tool
    if stream:
        with client.messages.stream(model="m", max_tokens=64, messages=messages, tools=WEATHER) as events:
            partial = [e.partial_json for e in events if e.type == "input_json"]
            first = events.get_final_message()
        assert "".join(partial) == json.dumps({"city": "Paris"})
    else:
        first = client.messages.create(
            model="m", max_tokens=64, messages=messages, tools=WEATHER, tool_choice={"type": "auto"}
        )
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert (use.type, use.name, use.input) == ("tool_use", "weather", {"city": "Paris"})
    # The client runs it and sends the result back
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]
    answer = client.messages.create(model="m", max_tokens=64, messages=messages, tools=WEATHER)
    # The model answers with what the tool said
    assert answer.stop_reason == "end_turn"
    assert answer.content[0].text.startswith("[simulated by simllm] the tool said: sunny, 21 C")
    sent = job_of(answer.id).input
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": WEATHER[0]["input_schema"],
                "description": "The weather in a city",
            },
        }
    ]
    assert sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": use.id, "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"},
    ]


def test_eight_concurrent_calls_all_answered_under_a_cap_of_two(stack, alice):
    executor = stack.executor(stack.trickle, max_concurrency=50)
    cap_team_a(2)
    client = sdk(stack, alice)
    answers, failures = [], []

    def call(i: int) -> None:
        try:
            if i % 2:
                with client.messages.stream(
                    model="m", max_tokens=64, messages=[{"role": "user", "content": f"{i}"}]
                ) as s:
                    answers.append(s.get_final_message().content[0].text)
            else:
                reply = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": f"{i}"}])
                answers.append(reply.content[0].text)
        except Exception as exc:
            failures.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures and len(answers) == 8, failures
    assert all(answer.startswith("[simulated by simllm]") for answer in answers)
    stats = stack.stats(executor)
    assert stats["requests"] == 8 and Job.objects.filter(status="done", meta__via="anthropic").count() == 8
    assert stats["peak"] == 2, f"at most two at the model server at once, and the cap was reached ({stats})"


def test_count_tokens(stack, alice):
    stack.executor(stack.simllm)
    counted = sdk(stack, alice).messages.count_tokens(model="m", system="Be brief.", messages=HELLO)
    assert counted.input_tokens == 12
    assert not Job.objects.exists(), "counting is not a model call"


class TestAuthAndErrors:
    def test_bearer_works_as_well_as_x_api_key(self, stack, alice):
        stack.executor(stack.simllm)
        body = {"model": "m", "max_tokens": 2, "messages": HELLO}
        bearer = httpx.post(
            f"{stack.base}/v1/messages", json=body, headers={"Authorization": f"Bearer {token(alice)}"}, timeout=60
        )  # a job: it waits for the test's worker to start
        assert bearer.status_code == 200 and bearer.json()["type"] == "message"
        nobody = httpx.post(f"{stack.base}/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert nobody.status_code == 401
        assert nobody.json()["type"] == "error" and nobody.json()["error"]["type"] == "authentication_error"

    def test_unknown_key_is_the_sdks_authentication_error(self, stack, alice):
        client = Anthropic(base_url=stack.base, api_key="not-a-token", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            client.messages.create(model="m", max_tokens=2, messages=HELLO)
        assert caught.value.body["error"]["type"] == "authentication_error"

    @pytest.mark.parametrize(
        "extra, param",
        [
            ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
            ({"extra_body": {"top_k": 5}}, "top_k"),
            ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
            (
                {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
                "messages[0].content[0].type",
            ),
            ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
            ({"max_tokens": 0}, "max_tokens"),
        ],
    )
    def test_refusals_name_the_field_in_anthropics_shape(self, stack, alice, extra, param):
        stack.executor(stack.simllm)
        with pytest.raises(anthropic.BadRequestError) as caught:
            sdk(stack, alice).messages.create(**{"model": "m", "max_tokens": 8, "messages": HELLO, **extra})
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"] == param and param.split("[")[0].split(".")[0] in body["error"]["message"]
        assert not Job.objects.exists()

    def test_unknown_model_is_not_found(self, stack, alice):
        stack.executor(stack.simllm)
        with pytest.raises(anthropic.NotFoundError) as caught:
            sdk(stack, alice).messages.create(model="claude-17", max_tokens=8, messages=HELLO)
        assert caught.value.body["error"] == {
            "type": "not_found_error",
            "message": caught.value.body["error"]["message"],
            "code": "model_not_found",
            "param": "model",
        }

    def test_a_full_queue_is_a_rate_limit_error(self, stack, alice):
        stack.executor(stack.simllm)
        queue_policy_update(changes={"max_queue_depth": {"a": 0}}, by=None)
        with pytest.raises(anthropic.RateLimitError) as caught:
            sdk(stack, alice).messages.create(model="m", max_tokens=8, messages=HELLO)
        assert caught.value.body["error"]["type"] == "rate_limit_error"
        assert int(caught.value.response.headers["retry-after"]) >= 1

    @pytest.mark.parametrize("stream", [False, True])
    def test_an_executor_that_keeps_failing_is_an_api_error(self, stack, alice, stream):
        stack.executor(stack.faults, prefix="502")
        queue_policy_update(changes={"max_attempts": 2}, by=None)
        with pytest.raises(anthropic.InternalServerError) as caught:
            if stream:
                with sdk(stack, alice).messages.stream(model="m", max_tokens=8, messages=HELLO) as events:
                    list(events)
            else:
                sdk(stack, alice).messages.create(model="m", max_tokens=8, messages=HELLO)
        assert caught.value.status_code == 502 and caught.value.body["error"]["type"] == "api_error"
        assert caught.value.response.headers["x-should-retry"] == "false"

    def test_the_openai_switch_covers_messages(self, stack, alice):
        stack.executor(stack.simllm)
        feature_set(feature="openai", team=Team.objects.get(slug="a"), enabled=False, by=None)
        with pytest.raises(anthropic.PermissionDeniedError) as caught:
            sdk(stack, alice).messages.create(model="m", max_tokens=8, messages=HELLO)
        assert caught.value.body["error"]["code"] == "feature_disabled"
        assert not Job.objects.exists()

    def test_too_large_and_unknown_paths(self, stack, alice):
        headers = {"x-api-key": token(alice)}
        huge = httpx.post(
            f"{stack.base}/v1/messages",
            headers=headers,
            json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 1_100_000}]},
        )
        assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
        lost = httpx.post(f"{stack.base}/v1/messages/nothing-here", headers=headers, json={})
        assert lost.status_code == 404 and lost.json()["error"]["type"] == "not_found_error"
        # Message Batches are served (docs/batches.md): a create without requests is refused.
        empty = httpx.post(f"{stack.base}/v1/messages/batches", headers=headers, json={})
        assert empty.status_code == 400 and empty.json()["error"]["type"] == "invalid_request_error"
        wrong = httpx.get(f"{stack.base}/v1/messages", headers=headers)
        assert wrong.status_code == 405 and wrong.json()["type"] == "error"
