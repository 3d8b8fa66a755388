"""The OpenAI-compatible endpoint as apps use it: the official `openai` package against the API server,
real workers and real model servers. Every call is a governed job: queued, placed under caps,
canceled when its caller leaves."""

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from executors.models import Executor
from quotas.models import Usage
from quotas.services import quota_policy_create
from scheduler.models import Job, JobEvent, Slot
from scheduler.services.policy import queue_policy_update
from telemachus.control.features import feature_set
from telemachus.models import Team
from tests.processes import wait_until
from tests.scheduler.gateway.conftest import WORKER_ENV, live_deltas, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "hello there"}]
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def sdk(stack, user, **options) -> OpenAI:
    options.setdefault("max_retries", 0)
    options.setdefault("timeout", 60)
    return OpenAI(base_url=f"{stack.base}/v1", api_key=token(user), **options)


def job_of(completion_id: str) -> Job:
    return Job.objects.get(pk=int(completion_id.removeprefix("chatcmpl-")))


class TestModels:
    def test_lists_the_models_the_team_may_use(self, stack, alice, make_team, make_user):
        stack.executor(stack.simllm, models=["m", "e"])
        stack.executor(stack.simllm, models=["retired"], enabled=False)
        stack.executor(stack.simllm, models=["bs-own"], team=make_team("b2", {make_user(): "member"}))
        client = sdk(stack, alice)
        assert [model.id for model in client.models.list()] == ["e", "m"]
        assert client.models.retrieve("m").id == "m"
        with pytest.raises(openai.NotFoundError) as caught:
            client.models.retrieve("bs-own")
        assert caught.value.code == "model_not_found"

    def test_a_cpu_node_pseudo_model_is_not_a_chat_model(self, stack, alice):
        stack.executor(stack.simllm)
        Executor.objects.create(
            name="cpu", kind="cpu-node", capabilities={"models": ["cpu"], "class": "cpu"}, max_concurrency=2
        )
        client = sdk(stack, alice)
        assert [model.id for model in client.models.list()] == ["m"]
        with pytest.raises(openai.NotFoundError) as listed:
            client.models.retrieve("cpu")
        assert listed.value.code == "model_not_found"
        for stream in (False, True):
            with pytest.raises(openai.NotFoundError) as caught:
                client.chat.completions.create(model="cpu", messages=HELLO, stream=stream)
            assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
            assert "'cpu'" in caught.value.message
        assert not Job.objects.exists()

    def test_the_team_header_picks_a_team_the_caller_is_in(self, stack, alice, make_team):
        make_team("c", {alice: "member"})
        stack.executor(stack.simllm)
        with pytest.raises(openai.BadRequestError) as ambiguous:
            sdk(stack, alice).models.list()
        assert ambiguous.value.code == "team_required"
        assert [m.id for m in sdk(stack, alice, default_headers={"X-Telemachus-Team": "c"}).models.list()] == ["m"]
        with pytest.raises(openai.NotFoundError) as outsider:
            sdk(stack, alice, default_headers={"X-Telemachus-Team": "b"}).models.list()
        assert outsider.value.code == "team_not_found"


class TestChat:
    def test_plain(self, stack, alice):
        stack.executor(stack.simllm)
        reply = sdk(stack, alice).chat.completions.create(model="m", messages=HELLO, max_tokens=4)
        assert reply.object == "chat.completion" and reply.model == "m"
        assert reply.choices[0].message.content == "[simulated by simllm] sim0 sim1 sim2 sim3"
        assert reply.choices[0].finish_reason == "length"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (6, 4, 10)
        job = job_of(reply.id)
        assert (job.status, job.team.slug, job.user, job.type, job.meta) == (
            "done",
            "a",
            alice,
            "chat",
            {"via": "openai"},
        )
        assert job.requirements == {"model": "m", "est_tokens": 10, "on_budget_exhausted": "fail"}, (
            "the prompt and max_tokens"
        )

    def test_streamed(self, stack, alice):
        executor = stack.executor(stack.trickle)
        stream = sdk(stack, alice).chat.completions.create(
            model="m", messages=HELLO, stream=True, stream_options={"include_usage": True}
        )
        chunks, running_at_first_text = [], None
        for chunk in stream:
            chunks.append(chunk)
            if running_at_first_text is None and chunk.choices and chunk.choices[0].delta.content:
                running_at_first_text = job_of(chunk.id).status == "running"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        job = job_of(chunks[0].id)
        assert (
            text == job.result["message"]["content"] == "[simulated by simllm] " + " ".join(f"sim{i}" for i in range(8))
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        assert stack.stats(executor)["requests"] == 1
        if live_deltas():
            assert running_at_first_text, "text arrived while the model was still writing"
            assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2

    @pytest.mark.parametrize("stream", [False, True])
    def test_tools_round_trip(self, stack, alice, stream):
        stack.executor(stack.simllm)
        client = sdk(stack, alice)
        messages = [{"role": "user", "content": "Paris"}]
        if stream:
            chunks = list(client.chat.completions.create(model="m", messages=messages, tools=WEATHER, stream=True))
            # The call as a client assembles it: the first piece names it, the rest add arguments
            # (one piece or many, as the model's stream reaches the relay).
            pieces = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
            assert {piece.index for piece in pieces} == {0} and pieces[0].id and pieces[0].function.name
            assert all(piece.id is None and piece.function.name is None for piece in pieces[1:])
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
            name, call_id = pieces[0].function.name, pieces[0].id
            arguments = "".join(piece.function.arguments or "" for piece in pieces)
        else:
            first = client.chat.completions.create(model="m", messages=messages, tools=WEATHER, tool_choice="auto")
            assert first.choices[0].finish_reason == "tool_calls"
            (call,) = first.choices[0].message.tool_calls
            name, arguments, call_id = call.function.name, call.function.arguments, call.id
        assert (name, json.loads(arguments)) == ("weather", {"city": "Paris"})
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
        ]
        answer = client.chat.completions.create(model="m", messages=messages, tools=WEATHER)
        assert answer.choices[0].message.content.startswith("[simulated by simllm] the tool said: sunny, 21 C")
        sent = job_of(answer.id).input
        assert sent["tools"] == WEATHER and sent["messages"][2]["tool_call_id"] == call_id

    def test_embeddings(self, stack, alice):
        stack.executor(stack.simllm, models=["e"], capabilities={"embeddings": True})
        stack.executor(stack.simllm, models=["m"])
        client = sdk(stack, alice)
        floats = client.embeddings.create(model="e", input=["one two", "three"], encoding_format="float")
        packed = client.embeddings.create(model="e", input=["one two", "three"])  # the SDK asks for base64
        assert [len(item.embedding) for item in floats.data] == [16, 16] and floats.usage.prompt_tokens == 3
        for unpacked, plain in zip(packed.data, floats.data, strict=True):
            assert unpacked.embedding == pytest.approx(plain.embedding, abs=1e-6)
        with pytest.raises(openai.NotFoundError) as caught:
            client.embeddings.create(model="m", input="no executor embeds with m")
        assert caught.value.code == "model_not_found"


class TestErrors:
    """Each error in OpenAI's shape, with the status the SDK turns into its own exception."""

    def test_unknown_api_key(self, stack, alice):
        stack.executor(stack.simllm)
        client = OpenAI(base_url=f"{stack.base}/v1", api_key="not-a-token", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            client.chat.completions.create(model="m", messages=HELLO)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["message"]

    def test_unknown_model(self, stack, alice):
        stack.executor(stack.simllm)
        with pytest.raises(openai.NotFoundError) as caught:
            sdk(stack, alice).chat.completions.create(model="gpt-17", messages=HELLO)
        assert caught.value.code == "model_not_found" and caught.value.param == "model"
        assert not Job.objects.exists()

    @pytest.mark.parametrize(
        "body, param",
        [
            ({"model": "m", "messages": []}, "messages"),
            ({"model": "m"}, "messages"),
            ({"messages": HELLO}, "model"),
            ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
            ({"model": "m", "messages": HELLO, "temperature": 5}, "temperature"),
            ({"model": "m", "messages": HELLO, "max_tokens": "lots"}, "max_tokens"),
            ({"model": "m", "messages": HELLO, "n": 2}, "n"),
            ({"model": "m", "messages": HELLO, "tools": [{"type": "function"}]}, "tools[0]"),
            ({"model": "m", "messages": HELLO, "stream_options": {"include_usage": True}}, "stream_options"),
        ],
    )
    def test_bad_bodies(self, stack, alice, body, param):
        stack.executor(stack.simllm)
        response = httpx.post(
            f"{stack.base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token(alice)}"}
        )
        assert response.status_code == 400
        assert (
            response.json()["error"]["param"] == param and response.json()["error"]["type"] == "invalid_request_error"
        )
        assert not Job.objects.exists()

    @pytest.mark.parametrize("path", ["chat/completions", "embeddings"])
    @pytest.mark.parametrize(
        "raw, param",
        [
            ('{"model": "m", "messages": ' + "[" * 1000 + "]" * 1000 + "}", None),
            ('{"model": "m", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
            ('{"model": "m", "messages": ' + "[" * 70 + "]" * 70 + "}", "messages[0][0]"),
            (
                '{"model": "m", "input": ["x"], "messages": [{"role": "user", "content": "\\ud800"}]}',
                "messages[0].content",
            ),
            (
                '{"model": "m", "input": ["x"], "messages": [{"role": "user", "content": "a\\u0000b"}]}',
                "messages[0].content",
            ),
            (
                '{"model": "m", "input": ["x"], "messages": [{"role": "user", "content": "x", "\\udfff": 1}]}',
                "messages[0]",
            ),
        ],
        ids=["deep", "deeper", "past-the-limit", "surrogate", "nul", "surrogate-key"],
    )
    def test_unstorable_bodies_are_400_not_500(self, stack, alice, path, raw, param):
        stack.executor(stack.simllm, models=["m"], capabilities={"embeddings": True})
        response = httpx.post(
            f"{stack.base}/v1/{path}",
            content=raw.encode(),
            headers={"Authorization": f"Bearer {token(alice)}", "Content-Type": "application/json"},
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["param"] is None if param is None else error["param"].startswith(param), error
        assert not Job.objects.exists()

    def test_not_json_and_unknown_paths(self, stack, alice):
        headers = {"Authorization": f"Bearer {token(alice)}"}
        garbled = httpx.post(f"{stack.base}/v1/chat/completions", content=b"{nope", headers=headers)
        assert garbled.status_code == 400 and "JSON" in garbled.json()["error"]["message"]
        lost = httpx.post(f"{stack.base}/v1/completions", json={}, headers=headers)
        assert lost.status_code == 404 and lost.json()["error"]["code"] == "unknown_url"
        wrong = httpx.get(f"{stack.base}/v1/chat/completions", headers=headers)
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"

    def test_what_django_would_refuse_is_refused_here_too(self, stack, alice):
        headers = {"Authorization": f"Bearer {token(alice)}"}
        huge = httpx.post(
            f"{stack.base}/v1/chat/completions",
            headers=headers,
            json={"model": "m", "messages": [{"role": "user", "content": "x" * 1_100_000}]},
        )
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "payload_too_large"
        spoofed = httpx.get(f"{stack.base}/v1/models", headers={**headers, "Host": "evil.example"})
        assert spoofed.status_code == 400 and "Host" in spoofed.json()["error"]["message"]
        assert not Job.objects.exists()

    def test_a_team_without_chat_permission(self, stack, make_user, make_team):
        carol = make_user("carol")
        make_team("nochat", {carol: "member"}, grants=())
        stack.executor(stack.simllm)
        with pytest.raises(openai.PermissionDeniedError) as caught:
            sdk(stack, carol).chat.completions.create(model="m", messages=HELLO)
        assert "chat:use" in caught.value.message

    @pytest.mark.parametrize("switched_off_for", ["everyone", "the team"])
    def test_the_openai_switch_off_refuses_every_call(self, stack, alice, switched_off_for):
        stack.executor(stack.simllm, models=["m", "e"], capabilities={"embeddings": True})
        team = Team.objects.get(slug="a")
        feature_set(feature="openai", team=None if switched_off_for == "everyone" else team, enabled=False, by=None)
        client = sdk(stack, alice)
        calls = {
            "models": lambda: client.models.list(),
            "model": lambda: client.models.retrieve("m"),
            "chat": lambda: client.chat.completions.create(model="m", messages=HELLO),
            "stream": lambda: client.chat.completions.create(model="m", messages=HELLO, stream=True),
            "embeddings": lambda: client.embeddings.create(model="e", input="x"),
            "bad body": lambda: client.chat.completions.create(model="m", messages=[]),
        }
        for name, call in calls.items():
            with pytest.raises(openai.PermissionDeniedError) as caught:
                call()
            assert (caught.value.status_code, caught.value.code) == (403, "feature_disabled"), name
            assert caught.value.body["type"] and "openai" in caught.value.body["message"], name
        assert not Job.objects.exists()
        # A team's own switch wins over the global one
        feature_set(feature="openai", team=team, enabled=switched_off_for == "everyone", by=None)
        if switched_off_for == "everyone":
            assert client.chat.completions.create(model="m", messages=HELLO, max_tokens=2).choices
        else:
            with pytest.raises(openai.PermissionDeniedError):
                client.models.list()

    def test_a_full_queue_is_try_later(self, stack, alice):
        stack.executor(stack.simllm)
        queue_policy_update(changes={"max_queue_depth": {"a": 0}}, by=None)
        with pytest.raises(openai.RateLimitError) as caught:
            sdk(stack, alice).chat.completions.create(model="m", messages=HELLO)
        assert caught.value.code == "try_later" and int(caught.value.response.headers["retry-after"]) >= 1

    def test_an_exhausted_budget_is_quota_exceeded(self, stack, alice):
        stack.executor(stack.simllm)
        quota_policy_create(scope="team", subject="a", dimension="ai.tokens", limit=50, window="day")
        with pytest.raises(openai.RateLimitError) as caught:
            sdk(stack, alice).chat.completions.create(model="m", messages=HELLO, max_tokens=100)
        headers = caught.value.response.headers
        assert caught.value.code == "quota_exceeded" and int(headers["retry-after"]) > 60
        assert headers["x-should-retry"] == "false", "the SDK must not retry a budget that resets tomorrow"

    def test_a_budget_spent_while_the_call_waits_is_quota_exceeded_at_once(self, stack, alice):
        # Given a call running on the team's only slot (its model takes 5 s), and a second call
        # queued behind it...
        stack.executor(stack.slow)
        quota_policy_create(scope="team", subject="a", dimension="ai.concurrency", limit=1)
        budget = quota_policy_create(scope="team", subject="a", dimension="ai.tokens", limit=10_000, window="day")
        client = sdk(stack, alice)
        outcomes: dict[str, object] = {}

        def call(name: str) -> None:
            try:
                outcomes[name] = client.chat.completions.create(model="m", messages=HELLO, max_tokens=8)
            except openai.APIError as exc:
                outcomes[name] = exc

        first = threading.Thread(target=call, args=("first",))
        first.start()
        wait_until(lambda: Job.objects.filter(status="running").exists(), timeout=20, what="the first call running")
        second = threading.Thread(target=call, args=("second",))
        second.start()
        wait_until(lambda: Job.objects.filter(status="queued").exists(), timeout=20, what="the second call queued")

        # When the team's budget is spent while it waits (an operator cuts it below what is held)...
        spent = time.monotonic()
        budget.limit = 10
        budget.save(update_fields=["limit"])
        second.join(timeout=30)

        # Then the waiting call answers 429 quota_exceeded with the budget's reset at once (it
        # used to hold its connection until the window reset), and the running one is unharmed.
        refused = outcomes["second"]
        assert isinstance(refused, openai.RateLimitError) and refused.code == "quota_exceeded", refused
        assert time.monotonic() - spent < 10, "at once, not when the window resets (a day)"
        assert (
            int(refused.response.headers["retry-after"]) > 60 and refused.response.headers["x-should-retry"] == "false"
        )
        assert "resets at" in refused.message
        waiting = Job.objects.get(pk=int(refused.response.headers["x-telemachus-job"]))
        assert waiting.status == "failed" and "spent while this job waited" in waiting.error
        first.join(timeout=30)
        assert not isinstance(outcomes["first"], Exception), outcomes["first"]

    @pytest.mark.parametrize("stream", [False, True])
    def test_an_executor_that_keeps_failing_is_502(self, stack, alice, stream):
        executor = stack.executor(stack.faults, prefix="502")
        queue_policy_update(changes={"max_attempts": 2}, by=None)
        with pytest.raises(openai.InternalServerError) as caught:
            sdk(stack, alice).chat.completions.create(model="m", messages=HELLO, stream=stream)
        assert caught.value.status_code == 502 and caught.value.code == "executor_error"
        assert "upstream says 502" in caught.value.message
        job = Job.objects.get(executor=executor)
        assert (job.status, job.attempts) == ("failed", 2), "answered after the retries, not before"

    def test_an_executor_that_does_not_answer_is_504(self, stack, alice):
        stack.executor(stack.faults, prefix="hang", transport={"timeout_s": 0.5})
        queue_policy_update(changes={"max_attempts": 1}, by=None)
        with pytest.raises(openai.InternalServerError) as caught:
            sdk(stack, alice).chat.completions.create(model="m", messages=HELLO)
        assert caught.value.status_code == 504 and caught.value.code == "executor_timeout"

    def test_a_call_that_waits_too_long_is_504_and_canceled(self, stack, alice):
        executor = stack.executor(stack.slow)
        impatient = stack.processes.api_server("impatient", TELEMACHUS_GATEWAY_TIMEOUT_SECONDS="1.5")
        client = OpenAI(base_url=f"{impatient}/v1", api_key=token(alice), max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="m", messages=HELLO)
        assert caught.value.status_code == 504 and caught.value.code == "timeout"
        job = Job.objects.get(pk=int(caught.value.response.headers["x-telemachus-job"]))
        assert job.status == "canceled" and not Slot.objects.exists()
        assert job.error == "timed out after 1.5 s" == JobEvent.objects.get(job=job, event="canceled").meta["reason"]
        wait_until(
            lambda: stack.stats(executor).get("disconnects") == 1,
            timeout=30,
            what="the model server to see its request aborted",
        )


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_cancels_its_job_and_frees_the_slot(stack, alice, stream):
    executor = stack.executor(stack.slow)
    quota_policy_create(scope="team", subject="a", dimension="ai.tokens", limit=100_000, window="day")
    body = json.dumps({"model": "m", "messages": HELLO, "stream": stream}).encode()
    host, port = stack.base.removeprefix("http://").split(":")
    # Given a call whose model takes 5 s, running at the model server
    client = socket.create_connection((host, int(port)))
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {token(alice)}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: stack.stats(executor).get("in_flight") == 1, timeout=30, what="the model call to start")
    job = Job.objects.get()
    assert job.status == "running" and Slot.objects.count() == 1
    # When the client hangs up
    client.close()
    # Then its job is canceled, its slot freed, and the model server's request aborted
    wait_until(lambda: Job.objects.get().status == "canceled", timeout=30, what="the job to be canceled")
    assert not Slot.objects.exists()
    canceled = JobEvent.objects.get(job=job, event="canceled")
    assert canceled.meta["by"] == "alice"
    # The reason says the client left, and the attempt the model server ran is billed its estimate
    job.refresh_from_db()
    assert job.error == "client disconnected" == canceled.meta["reason"]
    assert job.tokens_used == job.cost_estimate == 6 + 256 == canceled.meta["tokens"]
    ledger = Usage.objects.get(scope="team", subject="a")
    assert (ledger.tokens, ledger.reserved_tokens) == (262, 0)
    wait_until(
        lambda: stack.stats(executor).get("disconnects") == 1,
        timeout=30,
        what="the model server to see its request aborted",
    )


@pytest.mark.skipif(not live_deltas(), reason="output reaches the API process only at the end (SQLite, no Redis)")
def test_a_client_that_leaves_a_stream_midway_cancels_its_job(stack, alice):
    executor = stack.executor(stack.trickle)
    body = json.dumps({"model": "m", "messages": HELLO, "stream": True}).encode()
    host, port = stack.base.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)))
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {token(alice)}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    # Given a stream under way: the first text has arrived
    received = b""
    while b"simulated" not in received:
        received += client.recv(65536)
    assert b"200 OK" in received and Job.objects.get().status == "running"
    # When the client hangs up
    client.close()
    # Then the job is canceled, saying why, and the model server's request aborted
    wait_until(lambda: Job.objects.get().status == "canceled", timeout=30, what="the job to be canceled")
    assert not Slot.objects.exists()
    assert Job.objects.get().error == "client disconnected"
    wait_until(
        lambda: stack.stats(executor).get("disconnects") == 1,
        timeout=30,
        what="the model server to see its request aborted",
    )


def test_a_team_cap_of_two_holds_for_ten_concurrent_calls(stack, alice):
    stack.processes.worker("w2", concurrency=16, **WORKER_ENV)  # caps hold across worker processes
    executor = stack.executor(stack.trickle, max_concurrency=50)
    quota_policy_create(scope="team", subject="a", dimension="ai.concurrency", limit=2)
    client = sdk(stack, alice)
    answers, failures = [], []

    def call(i: int) -> None:
        try:
            reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"call {i}"}])
            answers.append(reply.choices[0].message.content)
        except Exception as exc:
            failures.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(10)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures and len(answers) == 10, failures
    stats = stack.stats(executor)
    assert stats["requests"] == 10
    assert stats["peak"] == 2, f"at most two at the model server at once, and the cap was reached ({stats})"
    assert time.monotonic() - started < 120
