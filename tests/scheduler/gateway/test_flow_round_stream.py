"""A streamed flow on the job stream (`GET /api/jobs/{id}/stream/`): each round's tool-call pieces
arrive while that round's model call writes them, tagged with the round, in order; a client that
reconnects with Last-Event-ID gets no piece twice and none missing; a chat's stream is as it was.
Real worker, API server and simllm (which streams tool calls); needs output deltas across processes
(PostgreSQL NOTIFY, or Redis)."""

import json
import signal
from collections import defaultdict
from collections.abc import Iterator

import httpx
import pytest

from scheduler.models import Job
from scheduler.services.submit import job_submit
from tests.processes import Processes
from tests.scheduler.gateway.conftest import WORKER_ENV, live_deltas, model_executor
from tests.scheduler.gateway.test_jobwatch import auth, submit

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not live_deltas(), reason="output reaches the API process only at the end (SQLite, no Redis)"),
]


@pytest.fixture(scope="module")
def slow_writer(servers, tmp_path_factory):
    """A model server that writes a tool call's arguments a piece (8 characters) every 0.2 s."""
    processes = Processes(tmp_path_factory.mktemp("slow-writer"))
    try:
        yield processes.simllm(latency_ms=30, models="m", tokens_per_s=5)
    finally:
        processes.stop_all()


def submit_flow(user, rounds: int) -> Job:
    """A streamed flow whose model calls the echo tool in each round but the last."""
    return job_submit(
        user=user,
        team="a",
        type="flow",
        requirements={"model": "m", "est_tokens": 10},
        input={"messages": [{"role": "user", "content": f"go [rounds:{rounds}]"}], "tools": ["echo"], "stream": True},
    )


def sse(response: httpx.Response) -> Iterator[tuple[str, dict, str | None]]:
    """(event, data, id) of a Server-Sent Events response, as they arrive."""
    event, data, ident = None, [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data.append(line.removeprefix("data: "))
        elif line.startswith("id: "):
            ident = line.removeprefix("id: ")
        elif not line and event:
            yield event, json.loads("\n".join(data)), ident
            event, data, ident = None, [], None


def answers(job: Job) -> list[dict]:
    """The flow's recorded answer of each round, in order."""
    return [message for message in job.conversation if message["role"] == "assistant"]


def assemble(pieces: list[dict]) -> dict[tuple[int, str], str]:
    """Each round's text and tool calls' arguments from the stream's pieces, checking each piece
    starts where the last of its part ended (no piece twice, no gap)."""
    parts: dict[tuple[int, str], str] = defaultdict(str)
    for name, data in pieces:
        key = (data["round"], f"tool:{data['index']}" if name == "tool_call" else "text")
        assert data["offset"] == len(parts[key]), f"{key}: a piece at {data['offset']} after {len(parts[key])}"
        parts[key] += data["text"]
    return dict(parts)


def recorded(job: Job) -> dict[tuple[int, str], str]:
    parts = {}
    for round_no, answer in enumerate(answers(job), start=1):
        if answer.get("content"):
            parts[(round_no, "text")] = answer["content"]
        for index, call in enumerate(answer.get("tool_calls") or ()):
            parts[(round_no, f"tool:{index}")] = call["function"]["arguments"]
    return parts


def test_each_rounds_tool_call_pieces_arrive_while_that_round_runs_tagged_in_order(stack, alice, slow_writer):
    # Given a model that writes tool calls' arguments piece by piece, and a flow of 4 rounds (3
    # of them calling a tool) submitted with stream: true
    model_executor(slow_writer)
    job = submit_flow(alice, 4)

    # When a client follows the job's stream
    seen, pieces, live = [], [], defaultdict(int)
    url = f"{stack.base}/api/jobs/{job.pk}/stream/"
    with httpx.stream("GET", url, headers=auth(alice), timeout=60) as response:
        for name, data, ident in sse(response):
            seen.append((name, data.get("event") if name == "event" else data.get("round"), ident))
            if name in ("delta", "tool_call"):
                pieces.append((name, data))
                if Job.objects.get(pk=job.pk).rounds < data["round"]:
                    live[(name, data["round"])] += 1  # arrived while its round's model call ran
            if name == "done":
                final = data
    job.refresh_from_db()

    # Then the flow is done in 4 rounds, and rounds 1-3 each streamed its tool call's pieces while
    # that round ran (in pieces, not whole: the worker coalesces pieces only while a send is slow)
    assert final["status"] == "done" and job.rounds == 4
    assert all(live[("tool_call", round_no)] >= 1 for round_no in (1, 2, 3)), dict(live)
    assert sum(live[("tool_call", round_no)] for round_no in (1, 2, 3)) > 3, dict(live)
    tool_rounds = [data["round"] for name, data in pieces if name == "tool_call"]
    assert tool_rounds == sorted(tool_rounds) and set(tool_rounds) == {1, 2, 3}
    # ... each round's pieces all before its round_finished event, and after the last one's
    ends = [i for i, (name, what, _) in enumerate(seen) if name == "event" and what == "round_finished"]
    assert len(ends) == 4
    for i, (name, round_no, _) in enumerate(seen):
        if name in ("delta", "tool_call"):
            assert (ends[round_no - 2] if round_no > 1 else -1) < i < ends[round_no - 1], seen
    # ... the call announced with its id and name, and the pieces add up to what each round recorded
    first = next(data for name, data in pieces if name == "tool_call")
    assert first["name"] == "echo" and first["id"] == answers(job)[0]["tool_calls"][0]["id"]
    assert assemble(pieces) == recorded(job)
    # ... the last round's text is the flow's answer
    assert assemble(pieces)[(4, "text")] == final["result"]["message"]["content"]
    # ... and every piece carries the stream's position as its SSE id
    assert all(ident for name, _, ident in seen if name in ("delta", "tool_call", "event"))


def test_a_client_that_reconnects_mid_flow_gets_no_piece_twice_and_none_missing(stack, alice, slow_writer):
    # Given a streamed flow of 4 rounds, and a client that leaves its stream after the first piece
    # of round 2's tool call
    model_executor(slow_writer)
    job = submit_flow(alice, 4)
    url = f"{stack.base}/api/jobs/{job.pk}/stream/"
    pieces, last_id = [], None
    with httpx.stream("GET", url, headers=auth(alice), timeout=60) as response:
        for name, data, ident in sse(response):
            last_id = ident or last_id
            if name in ("delta", "tool_call"):
                pieces.append((name, data))
                if name == "tool_call" and data["round"] == 2:
                    break
    left_in = Job.objects.get(pk=job.pk).rounds

    # When it reconnects with Last-Event-ID, while the flow goes on
    with httpx.stream("GET", url, headers={**auth(alice), "Last-Event-ID": last_id}, timeout=60) as response:
        again = [(name, data) for name, data, _ in sse(response) if name in ("delta", "tool_call")]
    job.refresh_from_db()

    # Then the two streams together are each round's output once, in order, with no gap
    assert left_in < 2 and job.status == "done"
    assert again[0][0] == "tool_call" and again[0][1]["round"] == 2 and again[0][1]["offset"] > 0
    assert assemble(pieces + again) == recorded(job)

    # ... and a stream opened after the flow ended gets every round's output from the record
    with httpx.stream("GET", url, headers=auth(alice), timeout=60) as response:
        late = [(name, data) for name, data, _ in sse(response) if name in ("delta", "tool_call")]
    assert assemble(late) == recorded(job)


def test_a_chat_jobs_stream_is_as_before(stack, alice):
    # Given a streamed chat
    stack.executor(stack.trickle)
    job = submit(alice, stream=True)

    # When a client follows its stream
    with httpx.stream("GET", f"{stack.base}/api/jobs/{job.pk}/stream/", headers=auth(alice), timeout=60) as response:
        seen = list(sse(response))

    # Then its deltas are {attempt, offset, text} with no SSE id, and nothing of rounds or tool calls
    deltas = [(data, ident) for name, data, ident in seen if name == "delta"]
    final = seen[-1][1]
    assert deltas and all(set(data) == {"attempt", "offset", "text"} and ident is None for data, ident in deltas)
    assert "".join(data["text"] for data, _ in deltas) == final["result"]["message"]["content"]
    assert {name for name, _, _ in seen} <= {"job", "event", "status", "delta", "done"}
    assert all(ident == str(data["id"]) for name, data, ident in seen if name == "event")


def test_a_round_run_again_after_its_worker_died_starts_over_under_its_next_attempt(
    servers, processes, alice, slow_writer
):
    # Given a streamed flow of 3 rounds on a worker with a short lease, and a client following it
    model_executor(slow_writer)
    job = submit_flow(alice, 3)
    doomed = processes.worker("doomed", concurrency=4, lease=3, **WORKER_ENV)
    url = f"{servers['base']}/api/jobs/{job.pk}/stream/"
    pieces = []
    with httpx.stream("GET", url, headers=auth(alice), timeout=90) as response:
        for name, data, _ in sse(response):
            if name in ("delta", "tool_call"):
                pieces.append((name, data))
                # When the worker is killed while round 2's tool call is being written
                if doomed.poll() is None and name == "tool_call" and data["round"] == 2:
                    doomed.send_signal(signal.SIGKILL)
                    doomed.wait(timeout=10)
                    processes.worker("rescuer", concurrency=4, lease=3, **WORKER_ENV)
            if name == "done":
                final = data
    job.refresh_from_db()

    # Then round 2 ran twice, and its second attempt's pieces start it over from offset 0, after
    # which none of the first attempt's come
    assert final["status"] == "done" and job.rounds == 3
    second = [data["attempt"] for _, data in pieces if data["round"] == 2]
    assert second[0] == 1 and second[-1] == 2 and second == sorted(second)
    restart = next(data for _, data in pieces if data["round"] == 2 and data["attempt"] == 2)
    assert restart["offset"] == 0
    # ... and the last attempt of each round adds up to what the round recorded
    last = {data["round"]: data["attempt"] for _, data in pieces}
    assert assemble([(n, d) for n, d in pieces if d["attempt"] == last[d["round"]]]) == recorded(job)
