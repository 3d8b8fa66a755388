"""A governed call's trace across the queue, read back from a real OTLP receiver (Arize Phoenix):
the caller's `traceparent` continued by the door, the job keeping the context, and the spans of
the process that claims and runs it (a worker, or the API process itself: one hop) joining the
same trace, parent by parent. Prompts and answers stay out of spans unless TELEMACHUS_TRACE_CONTENT=1.
"""

import json
import secrets

import httpx
import pytest
from django.db import connection
from openai import OpenAI

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import Job
from tests.credentials import token_for
from tests.otlp import OtlpReceiver
from tests.phoenix import phoenix  # noqa: F401  (fixture)
from tests.processes import wait_until
from tests.scheduler.gateway.conftest import may_chat, model_executor

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# A prompt no span may carry by default.
SECRET = "the-prompt-" + secrets.token_hex(4)


def tracing_env(phoenix, **extra: str) -> dict[str, str]:  # noqa: F811
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50", **extra}


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


class Tree:
    """A trace's spans, by name, with their parents."""

    def __init__(self, spans: list[dict]) -> None:
        self.spans = sorted(spans, key=lambda s: s["start_time"])
        self.by_id = {s["context"]["span_id"]: s for s in self.spans}

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    def one(self, name: str) -> dict:
        (span,) = self.named(name)
        return span

    def parent(self, span: dict) -> str:
        """The parent's name ('caller' for the caller's own span, outside the trace's spans)."""
        parent = self.by_id.get(span["parent_id"])
        return parent["name"] if parent is not None else "caller"

    def shape(self) -> set[tuple[str, str]]:
        return {(self.parent(s), s["name"]) for s in self.spans}

    def text(self) -> str:
        return repr([s["attributes"] for s in self.spans])


def trace_of(phoenix, trace_id: str, count: int) -> Tree:  # noqa: F811
    return Tree(phoenix.wait_for(trace_id, count=count))


def chat(base: str, token: str, header: str, content: str = SECRET) -> httpx.Response:
    answer = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8},
        headers={"Authorization": f"Bearer {token}", "traceparent": header},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer


def assert_model_call(tree: Tree, job_id: int, *, executor: Executor, worker_prefix: str) -> None:
    """The worker side of one model call: queue wait, claim (placement and caps), run, model call."""
    wait, claim, run, call = tree.one("job.queue_wait"), tree.one("job.claim"), tree.one("job.run"), tree.one("chat m")
    for span in (wait, claim, run):
        assert span["attributes"]["telemachus.job.id"] == job_id
        assert span["attributes"]["telemachus.team"] == "a"
    assert wait["end_time"] <= claim["end_time"] <= call["start_time"]
    placed = claim["attributes"]
    assert (placed["telemachus.executor"], placed["telemachus.cap.executor"]) == (executor.name, 8)
    assert placed["telemachus.cap.team"] == 3 and placed["telemachus.worker"].startswith(worker_prefix)
    assert run["attributes"]["telemachus.executor"] == executor.name
    gen_ai = call["attributes"]
    assert (gen_ai["gen_ai.operation.name"], gen_ai["gen_ai.system"]) == ("chat", "openai")
    assert (gen_ai["gen_ai.request.model"], gen_ai["gen_ai.response.model"]) == ("m", "m")
    assert gen_ai["gen_ai.usage.input_tokens"] > 0 and gen_ai["gen_ai.usage.output_tokens"] > 0


@pytest.fixture
def stack(processes, member_setup):
    """alice (team a, chat allowed, a team cap of 3 slots) and a model server behind an executor."""
    alice, _, team_a, _, _ = member_setup
    may_chat(alice)
    Executor.objects.filter(name="shared").update(enabled=False)
    executor = model_executor(processes.simllm(latency_ms=20))
    QuotaPolicy.objects.create(scope="team", subject=team_a.slug, dimension="ai.concurrency", limit=3)
    connection.close()
    return token_for(alice), executor


def test_a_v1_call_run_by_a_worker_continues_the_callers_trace(processes, phoenix, stack):  # noqa: F811
    token, executor = stack
    api = processes.api_server("api", TELEMACHUS_GATEWAY_ONE_HOP="0", **tracing_env(phoenix, OTEL_SERVICE_NAME="api"))
    processes.worker("w", **tracing_env(phoenix, OTEL_SERVICE_NAME="worker"))

    # Given a caller inside its trace, when it calls /v1/ and a worker runs the call...
    trace_id, caller_span, header = traceparent()
    answer = chat(api, token, header)
    job_id = int(answer.headers["x-telemachus-job"])

    # Then one trace holds the door's spans and the worker's, each under its parent.
    tree = trace_of(phoenix, trace_id, count=6)
    assert tree.shape() == {
        ("caller", "POST /v1/chat/completions"),
        ("POST /v1/chat/completions", "job.submit"),
        ("job.submit", "job.queue_wait"),
        ("job.submit", "job.claim"),
        ("job.submit", "job.run"),
        ("job.run", "chat m"),
    }
    assert tree.one("POST /v1/chat/completions")["parent_id"] == caller_span
    assert tree.one("POST /v1/chat/completions")["attributes"]["telemachus.job.id"] == job_id
    assert_model_call(tree, job_id, executor=executor, worker_prefix="w")
    # And no span carries the prompt or the answer.
    assert SECRET not in tree.text() and answer.json()["choices"][0]["message"]["content"] not in tree.text()


def test_a_v1_call_run_in_the_api_process_one_hop(processes, phoenix, stack):  # noqa: F811
    token, executor = stack
    api = processes.api_server("api", TELEMACHUS_TRACE_CONTENT="1", **tracing_env(phoenix, OTEL_SERVICE_NAME="api"))

    # Given no worker at all: the API process claims and runs the call it holds.
    trace_id, caller_span, header = traceparent()
    answer = chat(api, token, header)
    job_id = int(answer.headers["x-telemachus-job"])

    tree = trace_of(phoenix, trace_id, count=6)
    assert tree.one("POST /v1/chat/completions")["parent_id"] == caller_span
    assert ("job.run", "chat m") in tree.shape() and ("job.submit", "job.claim") in tree.shape()
    assert_model_call(tree, job_id, executor=executor, worker_prefix="api:")
    # With TELEMACHUS_TRACE_CONTENT=1 the model call's span carries the prompt and the answer.
    gen_ai = tree.one("chat m")["attributes"]
    assert SECRET in gen_ai["gen_ai.input.messages"]
    assert answer.json()["choices"][0]["message"]["content"] in gen_ai["gen_ai.output.messages"]


@pytest.mark.parametrize(
    ("path", "body", "auth"),
    [
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, "x-api-key"),
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 8}, "authorization"),
    ],
)
def test_the_other_dialects_continue_the_trace_too(processes, phoenix, stack, path, body, auth):  # noqa: F811
    token, executor = stack
    api = processes.api_server("api", **tracing_env(phoenix, OTEL_SERVICE_NAME="api"))
    trace_id, caller_span, header = traceparent()
    credential = token if auth == "x-api-key" else f"Bearer {token}"
    answer = httpx.post(f"{api}{path}", json=body, headers={auth: credential, "traceparent": header}, timeout=60)
    assert answer.status_code == 200, answer.text

    tree = trace_of(phoenix, trace_id, count=6)
    assert tree.one(f"POST {path}")["parent_id"] == caller_span
    assert (f"POST {path}", "job.submit") in tree.shape() and ("job.run", "chat m") in tree.shape()
    assert tree.one("chat m")["attributes"]["telemachus.executor"] == executor.name


def test_a_job_api_submit_and_its_worker(processes, phoenix, stack):  # noqa: F811
    token, executor = stack
    api = processes.api_server("api", **tracing_env(phoenix, OTEL_SERVICE_NAME="api"))
    trace_id, caller_span, header = traceparent()
    body = {
        "type": "chat",
        "team": "a",
        "requirements": {"model": "m", "est_tokens": 50},
        "input": {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 8},
    }
    answer = httpx.post(
        f"{api}/api/jobs/", json=body, headers={"Authorization": f"Token {token}", "traceparent": header}, timeout=30
    )
    assert answer.status_code == 201, answer.text
    job_id = answer.json()["id"]

    # When a worker started later claims it (it waited in the queue meanwhile)...
    processes.worker("w", **tracing_env(phoenix, OTEL_SERVICE_NAME="worker"))
    tree = trace_of(phoenix, trace_id, count=6)
    assert tree.shape() == {
        ("caller", "POST /api/jobs/"),
        ("POST /api/jobs/", "job.submit"),
        ("job.submit", "job.queue_wait"),
        ("job.submit", "job.claim"),
        ("job.submit", "job.run"),
        ("job.run", "chat m"),
    }
    assert_model_call(tree, job_id, executor=executor, worker_prefix="w")
    wait = tree.one("job.queue_wait")
    assert wait["start_time"] <= tree.one("job.submit")["end_time"]
    assert SECRET not in tree.text()
    wait_until(lambda: Job.objects.get(pk=job_id).status == "done", timeout=30, what="the job to end")


def test_a_flow_traces_each_round_and_its_tools(processes, phoenix, stack, member_setup):  # noqa: F811
    token, _ = stack
    Executor.objects.filter(name="shared").update(enabled=True, meta={"latency_ms": 5})
    Executor.objects.exclude(name="shared").update(enabled=False)
    connection.close()
    api = processes.api_server("api", **tracing_env(phoenix, OTEL_SERVICE_NAME="api"))
    processes.worker("w", **tracing_env(phoenix, OTEL_SERVICE_NAME="worker"))
    trace_id, _, header = traceparent()
    body = {
        "type": "flow",
        "team": "a",
        "requirements": {"model": "m", "est_tokens": 50},
        "input": {"messages": [{"role": "user", "content": f"{SECRET} [rounds:2]"}], "tools": ["echo"]},
    }
    answer = httpx.post(
        f"{api}/api/jobs/", json=body, headers={"Authorization": f"Token {token}", "traceparent": header}, timeout=30
    )
    assert answer.status_code == 201, answer.text

    # Two rounds: each queued, claimed and run, the first calling the echo tool.
    tree = trace_of(phoenix, trace_id, count=2 + 2 * 4 + 1)
    rounds = tree.named("flow.round")
    assert [r["attributes"]["telemachus.flow.round"] for r in rounds] == [1, 2]
    assert all(tree.parent(r) == "job.submit" for r in rounds)
    assert len(tree.named("job.queue_wait")) == len(tree.named("job.claim")) == 2
    calls = tree.named("chat m")
    assert [call["parent_id"] for call in calls] == [r["context"]["span_id"] for r in rounds]
    (tool,) = tree.named("execute_tool echo")
    assert tool["parent_id"] == rounds[0]["context"]["span_id"]
    assert (tool["attributes"]["gen_ai.tool.name"], tool["attributes"]["gen_ai.operation.name"]) == (
        "echo",
        "execute_tool",
    )
    assert calls[0]["attributes"]["gen_ai.system"] == "sim"
    assert SECRET not in tree.text()


APP = """
import json, sys
import django
django.setup()
from django.contrib.auth import get_user_model
from opentelemetry import trace
from scheduler.tasks_backend import enqueue_as
from telemachus import tracing
from tests.scheduler.declared_tasks import add

tracing.tracing_setup(service_name="app")
# The app's own span, in the trace its own caller started.
with tracing.span("app.work", parent=tracing.context_from_headers({"traceparent": sys.argv[1]})):
    with enqueue_as(user=get_user_model().objects.get(username="alice"), team="a"):
        result = add.enqueue(2, 3)
trace.get_tracer_provider().force_flush()
print(json.dumps({"id": result.id}))
"""


def test_a_task_enqueued_inside_a_span_continues_its_trace(processes, phoenix, member_setup):  # noqa: F811
    Executor.objects.create(name="cpu-1", kind="cpu-node", capabilities={"models": ["cpu"]}, max_concurrency=2)
    connection.close()
    trace_id, caller_span, header = traceparent()

    # Given Django code that traces, enqueuing a task inside its span...
    app = processes.spawn("app", "-c", APP, header, **tracing_env(phoenix))
    assert app.wait(timeout=120) == 0, app.log_path.read_text()
    job_id = int(json.loads(app.log_path.read_text().splitlines()[-1])["id"])
    # When a worker runs it...
    processes.worker("w", **tracing_env(phoenix, OTEL_SERVICE_NAME="worker"))

    # Then the task's spans are in the app's trace, under its submit (a task has no model call).
    tree = trace_of(phoenix, trace_id, count=5)
    assert tree.shape() == {
        ("caller", "app.work"),
        ("app.work", "job.submit"),
        ("job.submit", "job.queue_wait"),
        ("job.submit", "job.claim"),
        ("job.submit", "job.run"),
    }
    assert tree.one("app.work")["parent_id"] == caller_span
    assert tree.one("job.run")["attributes"]["telemachus.job.type"] == "task"
    assert tree.one("job.claim")["attributes"]["telemachus.executor"] == "cpu-1"
    wait_until(lambda: Job.objects.get(pk=job_id).status == "done", timeout=30, what="the task to end")
    assert Job.objects.get(pk=job_id).result["value"] == 5


def test_each_line_of_a_batch_is_a_trace_of_its_own_linked_to_the_batch(processes, stack):
    # Given an API process and a worker sending spans to a receiver that keeps their links...
    token, executor = stack
    receiver = OtlpReceiver()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    try:
        api = processes.api_server("api", OTEL_SERVICE_NAME="api", **env)
        processes.worker("w", OTEL_SERVICE_NAME="worker", TELEMACHUS_BATCH_FEED_SECONDS="0.05", **env)

        # ...when a caller inside its trace creates a batch of three lines and one that admission
        # refuses when it is fed (no executor offers its model), and the worker runs it...
        trace_id, caller_span, header = traceparent()
        client = OpenAI(api_key=token, base_url=f"{api}/v1", default_headers={"traceparent": header}, max_retries=0)
        lines = [
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 4},
            }
            for custom_id, model in (("one", "m"), ("two", "m"), ("three", "m"), ("refused", "not-offered"))
        ]
        text = "".join(json.dumps(line) + "\n" for line in lines)
        uploaded = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_until(
            lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, timeout=60, what="the batch"
        )
        assert (done.request_counts.completed, done.request_counts.failed) == (3, 1)

        # Then its creation is a span of the caller's trace...
        (created,) = receiver.wait_for(
            lambda r: [s for s in r.trace(trace_id) if s["name"] == "POST /v1/batches"], what="the create's span"
        )
        assert created["parent_id"] == caller_span
        assert created["attributes"]["telemachus.batch.id"] == batch.id
        assert created["attributes"]["telemachus.batch.lines"] == 4
        link = {"trace_id": trace_id, "span_id": created["span_id"]}
        # ...each line a trace of its own, rooted at its `batch.line` span, linked to the creation...
        spans = receiver.wait_for(
            lambda r: (
                len(found := [s for s in r.named("batch.line") if s["attributes"]["telemachus.batch.id"] == batch.id])
                == 4
                and found
            ),
            what="four batch.line spans",
        )
        by_line = {span["attributes"]["telemachus.batch.custom_id"]: span for span in spans}
        for span in spans:
            assert span["parent_id"] is None and span["trace_id"] != trace_id and span["links"] == [link]
            assert span["service"] == "worker" and span["attributes"]["telemachus.team"] == "a"
        # ...holding the spans of the line's job, as a live call's trace holds them under its submit...
        for custom_id in ("one", "two", "three"):
            root = by_line[custom_id]
            job_id = root["attributes"]["telemachus.job.id"]
            assert Job.objects.get(pk=job_id).batch_id == batch.id
            trace = receiver.wait_for(
                lambda r, t=root["trace_id"]: len(found := r.trace(t)) >= 5 and found, what=f"line {custom_id}'s trace"
            )
            names = {s["span_id"]: s["name"] for s in trace}
            assert {(names.get(s["parent_id"], "none"), s["name"]) for s in trace} == {
                ("none", "batch.line"),
                ("batch.line", "job.queue_wait"),
                ("batch.line", "job.claim"),
                ("batch.line", "job.run"),
                ("job.run", "chat m"),
            }
            assert all(s["attributes"]["telemachus.job.id"] == job_id for s in trace if s["name"] != "chat m")
        # ...the refused line's span failed, with no job; the feed's admission is linked to the batch
        # too; and no span carries a prompt.
        refused = by_line["refused"]
        assert refused["status"] == 2 and "telemachus.job.id" not in refused["attributes"]
        feeds = [s for s in receiver.named("batch.feed") if s["attributes"]["telemachus.batch.id"] == batch.id]
        assert feeds and all(s["links"] == [link] for s in feeds)
        submits = {s["parent_id"] for s in receiver.named("job.submit") if s["service"] == "worker"}
        assert {s["span_id"] for s in feeds} <= submits
        assert SECRET not in repr(receiver.spans)
    finally:
        receiver.close()
