"""Model routes as apps use them (issue #39): the `openai` package against the API server, a real
worker and real model servers. A route falls back when its first model's server stops and comes
back when it returns; a prompt longer than the first model's window goes to the second; a queue
deadline behind a long job answers 429 at once, or moves a routed call to a free model; a
retryable failure falls back after the retries; spend follows the model that ran."""

import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from executors.models import Executor
from executors.routes import route_create
from quotas.models import Spend
from scheduler.models import Job, JobEvent
from scheduler.services.policy import queue_policy_update
from tests.processes import answers, free_port, wait_until
from tests.scheduler.gateway.conftest import WORKER_ENV, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HELLO = [{"role": "user", "content": "hello there"}]


def sdk(stack, user, **options) -> OpenAI:
    options.setdefault("max_retries", 0)
    options.setdefault("timeout", 60)
    return OpenAI(base_url=f"{stack.base}/v1", api_key=token(user), **options)


def job_of(completion_id: str) -> Job:
    return Job.objects.get(pk=int(completion_id.removeprefix("chatcmpl-")))


def moves(job: Job) -> list[tuple[str, str, str]]:
    return [
        (e.meta["from"], e.meta["to"], e.meta["reason"]) for e in JobEvent.objects.filter(job=job, event="fell_back")
    ]


def long_call(client: OpenAI, model: str, stack) -> threading.Thread:
    """A call that holds the slow server's only slot (5 s), once it does, and the test's worker
    claiming (a deadline is enforced by the claims of workers; the API process claims its calls
    only at submit)."""
    (worker,) = [p for p in stack.processes.procs if p.log_path.name.startswith("w1")]
    wait_until(lambda: "starting" in worker.log_path.read_text(), timeout=30, what="the worker to start")
    thread = threading.Thread(target=lambda: client.chat.completions.create(model=model, messages=HELLO))
    thread.start()
    wait_until(lambda: Job.objects.filter(status="running").exists(), timeout=20, what="the long call running")
    return thread


def health(executor: Executor) -> str:
    return Executor.objects.values_list("health", flat=True).get(pk=executor.pk)


def own_simllm(stack, port: int, models: str) -> str:
    """A model server of the test's own on `port` (so it can be stopped and started again there)."""
    stack.processes.start(f"simllm-{port}-{time.monotonic_ns()}", "simllm", "--port", str(port), "--models", models)
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(base + "/v1/models"), timeout=20, what="simllm to listen")
    return base


class TestRoutes:
    def test_v1_models_lists_routes_beside_models(self, stack, alice):
        stack.executor(stack.simllm, models=["m"])
        route_create(name="smart", models=["gone", "m"])
        route_create(name="elsewhere", models=["gone"])
        assert [model.id for model in sdk(stack, alice).models.list()] == ["m", "smart"]

    def test_a_route_falls_back_when_its_server_stops_and_comes_back_when_it_returns(self, stack, alice):
        # Given route smart = a (its only server of its own), then m, and a worker that probes
        # executors twice a second.
        port = free_port()
        own_simllm(stack, port, "a")
        server = stack.processes.procs[-1]
        first = stack.executor(f"http://127.0.0.1:{port}", models=["a"])
        stack.executor(stack.simllm, models=["m"])
        route_create(name="smart", models=["a", "m"])
        stack.processes.worker("prober", concurrency=1, **{**WORKER_ENV, "TELEMACHUS_PROBE_INTERVAL_SECONDS": "0.5"})
        client = sdk(stack, alice)
        served = client.chat.completions.create(model="smart", messages=HELLO)
        assert served.model == "a" and job_of(served.id).executor_id == first.pk

        # When a's server stops, calls go to m, saying why.
        server.kill()
        server.wait()
        wait_until(lambda: health(first) == "down", timeout=20, what="the probe to see a down")
        fallen = client.chat.completions.create(model="smart", messages=HELLO)
        assert fallen.model == "m" and moves(job_of(fallen.id)) == [("a", "m", "no_executor")]

        # Then, when a's server is back, calls go to a again.
        own_simllm(stack, port, "a")
        wait_until(lambda: health(first) == "ok", timeout=20, what="the probe to see a back")
        back = client.chat.completions.create(model="smart", messages=HELLO)
        assert back.model == "a" and moves(job_of(back.id)) == []

    def test_a_prompt_longer_than_the_first_window_goes_to_the_second_model(self, stack, alice):
        stack.executor(stack.simllm, models=["e"], capabilities={"context_window": 64})
        stack.executor(stack.simllm, models=["m"])
        route_create(name="smart", models=["e", "m"])
        client = sdk(stack, alice)
        assert client.chat.completions.create(model="smart", messages=HELLO).model == "e"
        long = [{"role": "user", "content": "word " * 200}]
        answered = client.chat.completions.create(model="smart", messages=long)
        assert answered.model == "m" and moves(job_of(answered.id)) == [("e", "m", "context_window")]

    def test_a_retryable_failure_falls_back_after_the_retries_and_spend_follows_the_model(self, stack, alice):
        stack.executor(stack.faults, models=["a"], prefix="502")
        stack.executor(stack.simllm, models=["m"], prices={"m": {"input": "1", "output": "2"}})
        route_create(name="smart", models=["a", "m"])
        queue_policy_update(changes={"max_attempts": 3}, by=None)
        answered = sdk(stack, alice).chat.completions.create(model="smart", messages=HELLO)
        job = job_of(answered.id)
        assert answered.model == "m" and job.status == "done"
        assert JobEvent.objects.filter(job=job, event="retry_scheduled").count() == 2
        (move,) = JobEvent.objects.filter(job=job, event="fell_back")
        assert (move.meta["from"], move.meta["to"], move.meta["reason"]) == ("a", "m", "failed")
        assert "gave up after 3 attempts" in move.meta["error"]
        assert list(Spend.objects.values_list("model", flat=True)) == ["m"]

    def test_embeddings_call_a_route_of_embedding_models(self, stack, alice):
        stack.executor(stack.simllm, models=["e"], capabilities={"embeddings": True})
        route_create(name="vectors", models=["gone", "e"])
        answered = sdk(stack, alice).embeddings.create(model="vectors", input=["one two"], encoding_format="float")
        assert answered.model == "e" and len(answered.data) == 1
        assert set(Job.objects.values_list("route", "model")) == {("vectors", "e")}

    def test_messages_and_responses_call_the_route(self, stack, alice):
        stack.executor(stack.simllm, models=["m"])
        route_create(name="smart", models=["m"])
        headers = {"authorization": f"Bearer {token(alice)}"}
        messages = httpx.post(
            f"{stack.base}/v1/messages",
            json={"model": "smart", "max_tokens": 16, "messages": HELLO},
            headers={**headers, "anthropic-version": "2023-06-01"},
            timeout=30,
        )
        assert messages.status_code == 200, messages.text
        responses = httpx.post(
            f"{stack.base}/v1/responses", json={"model": "smart", "input": "hello"}, headers=headers, timeout=30
        )
        assert responses.status_code == 200, responses.text
        assert set(Job.objects.values_list("route", "model")) == {("smart", "m")}


class TestQueueDeadlines:
    def test_half_a_second_behind_a_long_job_is_429_within_a_second(self, stack, alice):
        # Given the slow server's only slot held by a 5 s call...
        stack.executor(stack.slow, models=["m"], max_concurrency=1)
        client = sdk(stack, alice)
        long = long_call(client, "m", stack)
        # When a call that waits at most half a second comes...
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(
                model="m", messages=HELLO, extra_headers={"X-Telemachus-Max-Queue-Seconds": "0.5"}
            )
        took = time.monotonic() - started
        # Then it is refused soon after its deadline, saying so, not after the long call.
        assert caught.value.code == "queue_deadline_exceeded" and took < 1.5, took
        assert caught.value.response.headers["retry-after"] == "1"
        assert caught.value.response.headers["x-should-retry"] == "false"
        long.join(timeout=30)

    def test_the_api_process_enforces_its_calls_deadlines_with_no_worker_claiming(self, stack, alice):
        # Given no worker at all, and the slow server's only slot held by a call this API process
        # runs itself...
        (worker,) = [p for p in stack.processes.procs if p.log_path.name.startswith("w1")]
        worker.kill()
        worker.wait()
        stack.executor(stack.slow, models=["m"], max_concurrency=1)
        client = sdk(stack, alice)
        long = threading.Thread(target=lambda: client.chat.completions.create(model="m", messages=HELLO))
        long.start()
        wait_until(lambda: Job.objects.filter(status="running").exists(), timeout=20, what="the long call running")
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(
                model="m", messages=HELLO, extra_headers={"X-Telemachus-Max-Queue-Seconds": "0.5"}
            )
        assert caught.value.code == "queue_deadline_exceeded" and time.monotonic() - started < 1.5
        long.join(timeout=30)

    def test_a_routed_call_past_its_deadline_moves_to_a_free_model(self, stack, alice):
        stack.executor(stack.slow, models=["m"], max_concurrency=1)
        stack.executor(stack.simllm, models=["e"])
        route_create(name="smart", models=["m", "e"])
        client = sdk(stack, alice)
        long = long_call(client, "smart", stack)
        started = time.monotonic()
        answered = client.chat.completions.create(
            model="smart", messages=HELLO, extra_headers={"X-Telemachus-Max-Queue-Seconds": "0.5"}
        )
        took = time.monotonic() - started
        assert answered.model == "e" and took < 2, took
        assert moves(job_of(answered.id)) == [("m", "e", "queue_deadline")]
        long.join(timeout=30)

    def test_answers_say_their_wait_for_a_slot_and_the_overhead(self, stack, alice):
        # A call that runs at once (this API process claims it), then one behind a 5 s call (a
        # worker runs it when the slot frees).
        stack.executor(stack.slow, models=["m"], max_concurrency=1)
        client = sdk(stack, alice)
        long = long_call(client, "m", stack)
        started = time.monotonic()
        raw = client.chat.completions.with_raw_response.create(model="m", messages=HELLO)
        took = (time.monotonic() - started) * 1000
        queued, overhead = float(raw.headers["x-telemachus-queue-ms"]), float(raw.headers["x-telemachus-overhead-ms"])
        assert 1000 < queued < took and 0 <= overhead < took - queued - 4000, (queued, overhead, took)
        long.join(timeout=30)
        raw = client.chat.completions.with_raw_response.create(model="m", messages=HELLO)
        queued, overhead = float(raw.headers["x-telemachus-queue-ms"]), float(raw.headers["x-telemachus-overhead-ms"])
        assert 0 <= queued < 1000 and 0 <= overhead < 1000, (queued, overhead)

    def test_a_stream_says_its_wait_for_a_slot_but_not_what_it_knows_only_at_its_end(self, stack, alice):
        # Given a 5 s call holding the slow server's only slot, a stream behind it (a worker runs
        # it when the slot frees), then one that runs at once (this API process claims it).
        stack.executor(stack.slow, models=["m"], max_concurrency=1)
        client = sdk(stack, alice)
        long = long_call(client, "m", stack)
        started = time.monotonic()
        with client.chat.completions.with_streaming_response.create(model="m", messages=HELLO, stream=True) as raw:
            took = (time.monotonic() - started) * 1000
            headers = raw.headers
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        # Then its headers, sent before the answer, say its job and its wait, which was the long
        # call's rest; its cost and overhead, known only at its end, are not there.
        assert text and job_of(f"chatcmpl-{headers['x-telemachus-job']}").status == "done"
        queued = float(headers["x-telemachus-queue-ms"])
        assert 1000 < queued < took, (queued, took)
        assert "x-telemachus-overhead-ms" not in headers and "x-telemachus-cost" not in headers
        long.join(timeout=30)
        with client.chat.completions.with_streaming_response.create(model="m", messages=HELLO, stream=True) as raw:
            queued = float(raw.headers["x-telemachus-queue-ms"])
            list(raw.parse())
        assert 0 <= queued < 1000, queued

    def test_a_bad_header_is_400(self, stack, alice):
        stack.executor(stack.simllm, models=["m"])
        with pytest.raises(openai.BadRequestError):
            sdk(stack, alice).chat.completions.create(
                model="m", messages=HELLO, extra_headers={"X-Telemachus-Max-Queue-Seconds": "soon"}
            )
