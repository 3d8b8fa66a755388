"""OpenAI's Responses API as apps and agents use it: the official `openai` package and the OpenAI
Agents SDK (its default model, OpenAIResponsesModel) against the API server, real workers and a real model
server that speaks chat completions. Every call is a governed `chat` job under the team's caps."""

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from quotas.services import quota_policy_create
from scheduler.models import Job, JobEvent, Slot
from telemachus.control.features import feature_set
from telemachus.models import Team
from tests.processes import wait_until
from tests.scheduler.gateway.conftest import live_deltas, may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WEATHER = [
    {
        "type": "function",
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def sdk(stack, user, **options) -> OpenAI:
    options.setdefault("max_retries", 0)
    options.setdefault("timeout", 60)
    return OpenAI(base_url=f"{stack.base}/v1", api_key=token(user), **options)


def job_of(response_id: str) -> Job:
    return Job.objects.get(pk=int(response_id.removeprefix("resp_")))


def cap_team_a(limit: int) -> None:
    quota_policy_create(scope="team", subject="a", dimension="ai.concurrency", limit=limit)


@pytest.fixture
def alice(member_setup):
    alice, *_rest, shared = member_setup
    shared.delete()
    return may_chat(alice)


def test_plain(stack, alice):
    executor = stack.executor(stack.simllm)
    cap_team_a(1)
    reply = sdk(stack, alice).responses.create(
        model="m", input="hello there", instructions="Be brief.", max_output_tokens=4, temperature=0.5
    )
    assert reply.object == "response" and reply.status == "incomplete", "four tokens is the limit it hit"
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == "[simulated by simllm] sim0 sim1 sim2 sim3"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (4 + 2 + 4 + 2, 4)
    assert reply.instructions == "Be brief." and reply.store is False
    job = job_of(reply.id)
    assert (job.status, job.type, job.team.slug, job.meta) == ("done", "chat", "a", {"via": "responses"})
    assert job.input == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "temperature": 0.5,
    }
    assert [e.event for e in JobEvent.objects.filter(job=job).order_by("id")][-1] == "finished"
    assert stack.stats(executor)["requests"] == 1


def test_a_client_that_disconnects_cancels_its_job(stack, alice):
    executor = stack.executor(stack.slow)
    body = json.dumps({"model": "m", "input": "hello there"}).encode()
    host, port = stack.base.removeprefix("http://").split(":")
    # Given a call whose model takes 5 s, running at the model server
    client = socket.create_connection((host, int(port)))
    client.sendall(
        b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {token(alice)}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
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
    kinds, deltas = [], []
    with sdk(stack, alice).responses.stream(model="m", input="hello there") as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    expected = "[simulated by simllm] " + " ".join(f"sim{i}" for i in range(8))
    assert "".join(deltas) == final.output_text == expected == Job.objects.get().result["message"]["content"]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-5:] == [
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert {"response.output_item.added", "response.content_part.added"} <= set(kinds)
    assert final.status == "completed" and final.usage.output_tokens == 8
    assert stack.stats(executor)["requests"] == 1
    if live_deltas():
        # Relayed only at the end, the text would come as one piece: in pieces, it came as written
        # (test_live_protocol_streams.py times a stream against the job's end, without an SDK's costs)
        assert len(deltas) > 2


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(stack, alice, stream):
    stack.executor(stack.simllm)
    cap_team_a(1)
    client = sdk(stack, alice)
    items: list = [{"role": "user", "content": "Paris"}]
    # The model asks for a tool
    if stream:
        with client.responses.stream(model="m", input=items, tools=WEATHER) as events:
            argument_deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
            first = events.get_final_response()
        assert "".join(argument_deltas) == json.dumps({"city": "Paris"})
    else:
        first = client.responses.create(model="m", input=items, tools=WEATHER, tool_choice="auto")
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "weather", {"city": "Paris"})
    assert first.tools[0].name == "weather"
    # The client runs it and sends its output back
    items += [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    answer = client.responses.create(model="m", input=items, tools=WEATHER)
    # The model answers with what the tool said
    assert answer.output_text.startswith("[simulated by simllm] the tool said: sunny, 21 C")
    sent = job_of(answer.id).input
    assert sent["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER[0].items() if k != "type"}}], (
        "the Responses tool, as chat completions declare it"
    )
    assert sent["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "weather", "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]


@pytest.mark.parametrize("streamed", [False, True])
def test_agents_sdk_runs_a_tool_using_agent_with_its_default_model(stack, alice, streamed):
    """The OpenAI Agents SDK, unchanged: its default model (the Responses API) pointed here,
    run plainly and streamed."""
    from agents import Agent, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from agents.models.multi_provider import MultiProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    executor = stack.executor(stack.simllm)
    cap_team_a(1)
    called = []

    @function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=f"{stack.base}/v1", api_key=token(alice), max_retries=0))
    agent = Agent(name="forecaster", instructions="Answer with the weather.", model="m", tools=[weather])
    assert isinstance(MultiProvider().get_model("m"), OpenAIResponsesModel), "the SDK's default model"
    if streamed:

        async def run_streamed():
            run = Runner.run_streamed(agent, "Lisbon")
            kinds = [event.type async for event in run.stream_events()]
            assert "raw_response_event" in kinds
            return run

        result = asyncio.run(run_streamed())
    else:
        result = asyncio.run(Runner.run(agent, "Lisbon"))
    assert called == ["Lisbon"]
    assert result.final_output.startswith("[simulated by simllm] the tool said: sunny in Lisbon")
    jobs = list(Job.objects.order_by("id"))
    assert [job.meta["via"] for job in jobs] == ["responses", "responses"], "one governed job per model call"
    assert all(bool(job.input.get("stream")) == streamed for job in jobs)
    assert jobs[0].input["messages"][0] == {"role": "system", "content": "Answer with the weather."}
    assert jobs[1].input["messages"][-1]["role"] == "tool"
    assert stack.stats(executor)["peak"] == 1


def test_a_team_cap_of_two_holds_for_eight_concurrent_responses(stack, alice):
    executor = stack.executor(stack.trickle, max_concurrency=50)
    cap_team_a(2)
    client = sdk(stack, alice)
    answers, failures = [], []

    def call(i: int, stream: bool) -> None:
        try:
            if stream:
                with client.responses.stream(model="m", input=f"call {i}") as events:
                    answers.append(events.get_final_response().output_text)
            else:
                answers.append(client.responses.create(model="m", input=f"call {i}").output_text)
        except Exception as exc:
            failures.append(exc)

    threads = [threading.Thread(target=call, args=(i, i % 2 == 0)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures and len(answers) == 8, failures
    stats = stack.stats(executor)
    assert stats["requests"] == 8
    assert stats["peak"] == 2, f"at most two at the model server at once, and the cap was reached ({stats})"


class TestRefusals:
    """What the gateway cannot do is refused before anything is queued, naming the field."""

    @pytest.mark.parametrize(
        "extra, param",
        [
            ({"previous_response_id": "resp_1"}, "previous_response_id"),
            ({"store": True}, "store"),
            ({"conversation": "conv_1"}, "conversation"),
            ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"include": ["reasoning.encrypted_content"]}, "include"),
            ({"reasoning": {"effort": "high"}}, "reasoning"),
            ({"max_tool_calls": 3}, "max_tool_calls"),
            ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
            ({"max_output_tokens": 0}, "max_output_tokens"),
        ],
    )
    def test_a_400_names_the_field(self, stack, alice, extra, param):
        stack.executor(stack.simllm)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk(stack, alice).responses.create(**{"model": "m", "input": "hi", **extra})
        assert caught.value.param == param, caught.value.body
        assert caught.value.body["type"] == "invalid_request_error"
        assert not Job.objects.exists()

    def test_previous_response_id_says_responses_are_not_kept(self, stack, alice):
        stack.executor(stack.simllm)
        with pytest.raises(openai.BadRequestError) as caught:
            sdk(stack, alice).responses.create(model="m", input="hi", previous_response_id="resp_1")
        assert "not kept" in caught.value.message

    def test_the_openai_switch_covers_responses(self, stack, alice):
        stack.executor(stack.simllm)
        feature_set(feature="openai", team=Team.objects.get(slug="a"), enabled=False, by=None)
        with pytest.raises(openai.PermissionDeniedError) as caught:
            sdk(stack, alice).responses.create(model="m", input="hi")
        assert caught.value.code == "feature_disabled"
        assert not Job.objects.exists()

    def test_unknown_token_and_model(self, stack, alice):
        stack.executor(stack.simllm)
        response = httpx.post(f"{stack.base}/v1/responses", json={"model": "m", "input": "hi"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.NotFoundError) as caught:
            sdk(stack, alice).responses.create(model="gpt-17", input="hi")
        assert caught.value.code == "model_not_found"

    def test_other_methods_and_paths_are_refused_in_openais_shape(self, stack, alice):
        headers = {"Authorization": f"Bearer {token(alice)}"}
        wrong = httpx.get(f"{stack.base}/v1/responses", headers=headers)
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        assert wrong.headers["x-should-retry"] == "false"
        kept = httpx.get(f"{stack.base}/v1/responses/resp_1", headers=headers)
        assert kept.status_code == 404 and kept.json()["error"]["code"] == "unknown_url"
        assert httpx.post(f"{stack.base}/v1/responses/", headers=headers, json={}).status_code == 400
