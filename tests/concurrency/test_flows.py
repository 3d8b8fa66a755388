"""Flows with real worker processes and the real HTTP model server (simllm) on PostgreSQL: a slot per
round, other work between rounds, cancel, SIGKILL mid-round, billing and budgets per round,
priority at the round boundary, and a governed slot taken by app code."""

import asyncio
import signal
import threading
import time
from collections import Counter

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from executors.models import Executor
from quotas.models import QuotaPolicy, Usage
from scheduler.flows.governed import governed_slot
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from tests.processes import http_json, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def model_server(processes, member_setup):
    """simllm behind one `local-model` executor with one slot (the sim executor disabled)."""

    def start(latency_ms: float = 200, max_concurrency: int = 1) -> tuple[str, Executor]:
        base = processes.simllm(latency_ms=latency_ms)
        Executor.objects.filter(name="shared").update(enabled=False)
        executor = Executor.objects.create(
            name="llm",
            kind="local-model",
            endpoint=f"{base}/v1",
            capabilities={"models": ["m"]},
            max_concurrency=max_concurrency,
        )
        return base, executor

    return start


def close_connection() -> None:
    """Close the calling thread's connection (a thread's own, so the test database can be dropped)."""
    connection.close()


def submit_flow(user, rounds: int, team: str = "a", **input_extra) -> Job:
    return job_submit(
        user=user,
        team=team,
        type="flow",
        requirements={"model": "m", "est_tokens": 10},
        input={
            "messages": [{"role": "user", "content": f"work [rounds:{rounds}]"}],
            "tools": ["echo"],
            "max_rounds": 200,
            **input_extra,
        },
    )


def submit_chat(user, team: str, priority: int = 0, text: str = "hello") -> Job:
    return job_submit(
        user=user,
        team=team,
        type="chat",
        priority=priority,
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": text}], "max_tokens": 8},
    )


def flow_requests(base: str, job: Job) -> int:
    return http_json(f"{base}/stats")["jobs"].get(str(job.pk), 0)


def last_round_started(job: Job, before: int | None = None) -> int:
    events = JobEvent.objects.filter(job=job, event="round_started")
    if before is not None:
        events = events.filter(pk__lt=before)
    return max(events.values_list("meta__round", flat=True))


def rounds_finished(job: Job) -> list[int]:
    return list(
        JobEvent.objects.filter(job=job, event="round_finished").order_by("id").values_list("meta__round", flat=True)
    )


def test_one_slot_shared_by_a_20_round_flow_and_10_chats(processes, member_setup, model_server):
    # Given one executor with one slot, a 20-round flow running on it...
    alice, bob, *_ = member_setup
    base, _ = model_server(latency_ms=150)
    flow = submit_flow(alice, 20)
    processes.worker("w1", concurrency=8)
    processes.worker("w2", concurrency=8)
    wait_until(lambda: Job.objects.get(pk=flow.pk).rounds >= 1, timeout=30, what="the flow's first round")

    # When 10 chats are submitted while it runs (from its own team and another)...
    chats = [submit_chat(alice if i % 2 else bob, "a" if i % 2 else "b", text=f"chat {i}") for i in range(10)]
    wait_until(lambda: Job.objects.get(pk=flow.pk).status == "done", timeout=120, interval=0.2, what="the flow done")

    # Then every chat finished before the flow, the server never saw two requests at once, and it
    # saw exactly one request per round of the flow.
    flow.refresh_from_db()
    chat_ends = list(Job.objects.filter(pk__in=[c.pk for c in chats]).values_list("status", "finished_at"))
    assert all(status == "done" and ended < flow.finished_at for status, ended in chat_ends), chat_ends
    stats = http_json(f"{base}/stats")
    assert stats["peak"] == 1
    assert flow_requests(base, flow) == 20
    assert flow.rounds == 20 and rounds_finished(flow) == list(range(1, 21))
    assert flow.result["rounds"] == 20 and flow.result["message"]["role"] == "assistant"
    assert not Slot.objects.exists()


def test_cancel_mid_flow_stops_it_after_at_most_one_more_model_call(processes, member_setup, model_server):
    alice = member_setup[0]
    base, _ = model_server(latency_ms=300)
    flow = submit_flow(alice, 50)
    worker = processes.worker("w", concurrency=4)
    wait_until(lambda: Job.objects.get(pk=flow.pk).rounds >= 2, timeout=30, what="two rounds done")

    job_cancel(job_id=flow.pk, by=alice)
    at_cancel = flow_requests(base, flow)
    time.sleep(2.0)  # several round lengths: a flow that went on would have made more calls

    assert Job.objects.get(pk=flow.pk).status == "canceled"
    assert flow_requests(base, flow) - at_cancel <= 1
    assert http_json(f"{base}/stats")["in_flight"] == 0
    assert not Slot.objects.exists()
    assert not JobEvent.objects.filter(job=flow, event__in=["finished", "failed"]).exists()
    assert worker.poll() is None


def test_sigkill_mid_round_reruns_only_that_round(processes, member_setup, model_server):
    # Given a flow whose rounds take 1.5 s, with a budget so the ledger counts its tokens...
    alice = member_setup[0]
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=1_000_000, window="day")
    base, _ = model_server(latency_ms=1500)
    flow = submit_flow(alice, 5)
    doomed = processes.worker("doomed", concurrency=4, lease=3)
    wait_until(
        lambda: (
            JobEvent.objects.filter(job=flow, event="round_started", meta__round=2).exists()
            and http_json(f"{base}/stats")["in_flight"] == 1
        ),
        timeout=30,
        what="round 2 in flight",
    )

    # When its worker is killed in the middle of round 2's model call...
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(timeout=10)
    processes.worker("rescuer", concurrency=4, lease=3)
    wait_until(lambda: Job.objects.get(pk=flow.pk).status == "done", timeout=120, interval=0.2, what="flow done")

    # Then the flow finished with each round recorded (and billed) exactly once, none skipped;
    # only round 2 was asked twice.
    flow.refresh_from_db()
    assert rounds_finished(flow) == [1, 2, 3, 4, 5]
    assert JobEvent.objects.filter(job=flow, event="requeued").count() == 1
    assert flow_requests(base, flow) == 6
    billed = sum(JobEvent.objects.filter(job=flow, event="round_finished").values_list("meta__tokens", flat=True))
    assert billed == flow.tokens_used == flow.result["tokens"]
    usage = Usage.objects.get(scope="team", subject="a")
    assert (usage.tokens, usage.reserved_tokens) == (billed, 0)
    tool_results = [m for m in flow.conversation if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_results] == ["call_1", "call_2", "call_3", "call_4"]


def test_tokens_per_round_add_up_in_the_ledger_and_budgets_gate_each_round(processes, member_setup, model_server):
    # Given a team token budget that covers about two rounds of a ten-round flow...
    alice = member_setup[0]
    budget = QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=60, window="day")
    base, _ = model_server(latency_ms=50)
    flow = submit_flow(alice, 10, max_tokens=8)
    processes.worker("w", concurrency=4)

    # When it runs, it stops at the round that found the budget spent: deferred, holding nothing...
    wait_until(
        lambda: JobEvent.objects.filter(job=flow, event="deferred").exists(),
        timeout=30,
        what="the flow deferred by its budget",
    )
    time.sleep(1.5)
    flow.refresh_from_db()
    stopped_at = flow.rounds
    assert flow.status == "queued" and 1 <= stopped_at < 10
    assert flow_requests(base, flow) == stopped_at and not Slot.objects.exists()
    usage = Usage.objects.get(scope="team", subject="a")
    # Spent, up to the deferred round's estimate short (its prompt: the conversation so far).
    assert usage.tokens == flow.tokens_used >= 60 - flow.cost_estimate

    # ...and once the budget grows, the remaining rounds run; every round was billed once.
    QuotaPolicy.objects.filter(pk=budget.pk).update(limit=1_000_000)
    wait_until(lambda: Job.objects.get(pk=flow.pk).status == "done", timeout=60, interval=0.2, what="flow done")
    flow.refresh_from_db()
    per_round = list(JobEvent.objects.filter(job=flow, event="round_finished").values_list("meta__tokens", flat=True))
    assert len(per_round) == 10 and sum(per_round) == flow.tokens_used == flow.result["tokens"]
    usage.refresh_from_db()
    assert (usage.tokens, usage.reserved_tokens) == (sum(per_round), 0)


def test_a_higher_priority_job_runs_at_the_next_round_boundary(processes, member_setup, model_server):
    # Given a flow keeping its place between rounds (continue), on the only slot...
    alice = member_setup[0]
    QueuePolicy.objects.update_or_create(pk=1, defaults={"flow_rounds": "continue"})
    base, _ = model_server(latency_ms=300)
    flow = submit_flow(alice, 12)
    processes.worker("w", concurrency=4)
    wait_until(lambda: Job.objects.get(pk=flow.pk).rounds >= 2, timeout=30, what="two rounds done")

    # When its team submits a chat at its own priority, then an urgent one...
    in_flight = last_round_started(flow)
    patient = submit_chat(alice, "a", priority=0, text="patient")
    urgent = submit_chat(alice, "a", priority=5, text="urgent")
    wait_until(lambda: Job.objects.get(pk=flow.pk).status == "done", timeout=90, interval=0.2, what="flow done")
    wait_until(lambda: Job.objects.get(pk=patient.pk).status == "done", timeout=30, what="patient chat done")

    # Then the urgent one took the slot at the round boundary, before the round after the one in
    # flight (or the one just starting); the patient one waited for the whole flow.
    urgent_start = JobEvent.objects.get(job=urgent, event="started").pk
    assert last_round_started(flow, before=urgent_start) <= in_flight + 1
    assert Job.objects.get(pk=patient.pk).started_at > Job.objects.get(pk=flow.pk).finished_at


def test_a_governed_slot_waits_like_a_round_and_bills_what_it_reports(processes, member_setup, model_server):
    # Given the only slot busy with a slow chat...
    alice = member_setup[0]
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=1_000_000, window="day")
    base, executor = model_server(latency_ms=1500)
    chat = submit_chat(alice, "a")
    processes.worker("w", concurrency=4)
    wait_until(lambda: Job.objects.get(pk=chat.pk).status == "running", timeout=20, what="the chat running")

    # When app code asks for a governed slot, makes its own call in it and reports the tokens...
    seen = {}

    def app() -> None:
        with governed_slot(user=alice, team="a", model="m", est_tokens=50, timeout=60) as slot:
            seen["chat_status"] = Job.objects.get(pk=chat.pk).status
            seen["slots"] = Slot.objects.count()
            reply = httpx.post(
                f"{slot.endpoint}/chat/completions",
                timeout=30,
                headers=slot.headers(),
                json={"model": slot.model, "messages": [{"role": "user", "content": "mine"}]},
            ).json()
            slot.report(
                prompt_tokens=reply["usage"]["prompt_tokens"], completion_tokens=reply["usage"]["completion_tokens"]
            )
            seen["slot"] = slot
        close_connection()

    thread = threading.Thread(target=app)
    thread.start()
    thread.join(timeout=60)

    # Then it waited for the chat, held the one slot for its call, and was billed what it reported.
    slot = seen["slot"]
    assert seen["chat_status"] == "done" and seen["slots"] == 1
    assert (slot.executor, slot.model, slot.endpoint) == ("llm", "m", executor.endpoint)
    job = Job.objects.get(pk=slot.job_id)
    assert (job.type, job.status, job.tokens_used) == ("governed", "done", slot.tokens) and slot.tokens > 0
    events = Counter(JobEvent.objects.filter(job=job).values_list("event", flat=True))
    assert events["round_started"] == events["round_finished"] == 1
    chat_tokens = Job.objects.get(pk=chat.pk).tokens_used
    assert Usage.objects.get(scope="team", subject="a").tokens == chat_tokens + slot.tokens
    assert http_json(f"{base}/stats")["peak"] == 1 and not Slot.objects.exists()


def test_the_async_governed_slot_and_an_error_inside_it(processes, member_setup, model_server):
    alice = member_setup[0]
    model_server(latency_ms=50)
    processes.worker("w", concurrency=4)

    async def app() -> int:
        try:
            async with governed_slot(user=alice, team="a", model="m", timeout=30) as slot:
                slot.report(tokens=7)
                raise RuntimeError("the app's own call failed")
        except RuntimeError:
            return slot.job_id
        finally:
            await sync_to_async(close_connection)()

    job = Job.objects.get(pk=asyncio.run(app()))
    assert (job.status, job.tokens_used) == ("failed", 7)
    assert job.error == "RuntimeError: the app's own call failed"
    assert not Slot.objects.exists()


def test_the_async_governed_slot_is_granted_as_soon_as_it_is_claimed(processes, member_setup, model_server):
    # Given the only slot busy with a chat for 2 s (a polling wait would by then read every 0.5 s)...
    alice = member_setup[0]
    model_server(latency_ms=2000)
    chat = submit_chat(alice, "a")
    processes.worker("w", concurrency=4)
    wait_until(lambda: Job.objects.get(pk=chat.pk).status == "running", timeout=20, what="the chat running")

    # When app code waits for a governed slot behind it...
    async def app() -> tuple[int, float]:
        try:
            async with governed_slot(user=alice, team="a", model="m", timeout=60) as slot:
                granted = time.time()
                slot.report(tokens=1)
            return slot.job_id, granted
        finally:
            await sync_to_async(close_connection)()

    job_id, granted = asyncio.run(app())

    # Then it had its slot within a notification's time of the claim that took it, not a poll's.
    started = JobEvent.objects.get(job_id=job_id, event="started").at.timestamp()
    assert Job.objects.get(pk=chat.pk).status == "done"
    assert granted - started < 0.2, granted - started  # about 0.03 s here; polling read every 0.5 s
