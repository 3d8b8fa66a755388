"""Flows, tool jobs and translate jobs end to end with a real worker process, on either backend:
the sim executor in the worker, and simllm over real HTTP."""

import pytest
from django.db import connection

from executors.models import Executor
from scheduler.models import Job, JobEvent
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from telemachus.control.features import feature_set
from tests.processes import http_json, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
TOOLBOX = "boom=tests.executors.test_tools.boom,nap=tests.executors.test_tools.nap"


@pytest.fixture
def toolbox(settings):
    """The test tools, registered here (for the submit's checks) and in the worker (its environment)."""
    settings.TELEMACHUS_TOOLS = TOOLBOX.split(",")


def ended(*jobs: Job, timeout: float = 60) -> list[Job]:
    ids = [job.pk for job in jobs]
    wait_until(
        lambda: Job.objects.filter(pk__in=ids, status__in=Job.TERMINAL).count() == len(ids),
        timeout=timeout,
        interval=0.1,
        what="the jobs to end",
    )
    return [Job.objects.get(pk=pk) for pk in ids]


def flow(user, prompt: str, tools=("echo",), **input_extra) -> Job:
    return job_submit(
        user=user,
        team="a",
        type="flow",
        requirements={"model": "m", "est_tokens": 10},
        input={"messages": [{"role": "user", "content": prompt}], "tools": list(tools), **input_extra},
    )


def test_flow_tool_and_translate_jobs(processes, member_setup):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 20}, max_concurrency=1)
    agent = flow(alice, "plan the trip [rounds:4]", tools=("echo", "clock"))
    tool = job_submit(
        user=alice, team="a", type="tool", requirements={}, input={"tool": "echo", "arguments": {"city": "Ithaca"}}
    )
    translate = job_submit(
        user=alice,
        team="a",
        type="translate",
        requirements={"model": "m"},
        input={"text": "good morning", "target_lang": "Greek", "max_tokens": 8},
    )
    processes.worker("w", concurrency=4, TELEMACHUS_TOOLS=TOOLBOX)
    agent, tool, translate = ended(agent, tool, translate)

    # The flow: four rounds (three calls of the first tool, then an answer), its tokens summed.
    assert agent.status == "done" and agent.rounds == 4
    assert agent.result["rounds"] == 4 and agent.result["tokens"] == agent.tokens_used > 0
    assert agent.result["message"]["content"].startswith("[simulated reply from shared]")
    assert [m["role"] for m in agent.conversation] == ["assistant", "tool"] * 3 + ["assistant"]
    assert agent.conversation[1] == {"role": "tool", "tool_call_id": "call_1", "content": '{"round": 1}'}
    finished = JobEvent.objects.filter(job=agent, event="round_finished").order_by("id")
    assert [e.meta["tools"] for e in finished] == [["echo"]] * 3 + [[]]
    # The tool job ran the tool, on no executor.
    assert tool.status == "done" and tool.executor is None and tool.tokens_used == 0
    assert tool.result["tool"] == "echo" and tool.result["value"] == {"city": "Ithaca"}
    # The translate job went through the template; its result is the text.
    assert translate.status == "done"
    assert translate.result["text"] == "[simulated reply from shared] good morning"
    connection.close()


def test_a_raising_tool_fails_the_flow_unless_its_errors_go_back_to_the_model(processes, member_setup, toolbox):
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 10})
    strict = flow(alice, "try [rounds:3]", tools=("boom",))
    lenient = flow(alice, "try [rounds:3]", tools=("boom",), return_tool_errors=True)
    tool = job_submit(user=alice, team="a", type="tool", requirements={}, input={"tool": "boom"})
    processes.worker("w", concurrency=4, TELEMACHUS_TOOLS=TOOLBOX)
    strict, lenient, tool = ended(strict, lenient, tool)

    assert (strict.status, strict.rounds) == ("failed", 1)
    assert strict.error == "tool 'boom' raised ValueError: no such thing"
    assert (lenient.status, lenient.rounds) == ("done", 3)
    assert '"error": "tool \'boom\' raised ValueError: no such thing"' in lenient.conversation[1]["content"]
    assert (tool.status, tool.error) == ("failed", "tool 'boom' raised ValueError: no such thing")
    connection.close()


def test_cancel_while_the_tools_run(processes, member_setup, toolbox):
    # Given a flow whose tool takes long (the sim model calls it at once)...
    alice, _, _, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 10})
    stuck = flow(alice, "wait [rounds:3]", tools=("nap",))
    worker = processes.worker("w", concurrency=4, TELEMACHUS_TOOLS=TOOLBOX)
    wait_until(lambda: Job.objects.get(pk=stuck.pk).rounds == 1, timeout=30, what="round 1 done")

    # When it is canceled while the tool runs: it ends canceled, and no second round starts.
    job_cancel(job_id=stuck.pk, by=alice)
    wait_until(
        lambda: (
            "aborting dispatch (canceled)" in worker.log_path.read_text()
            or "aborting dispatch (lease lost)" in worker.log_path.read_text()
        ),
        timeout=10,
        what="the abort",
    )
    job = Job.objects.get(pk=stuck.pk)
    assert (job.status, job.rounds) == ("canceled", 1)
    assert not JobEvent.objects.filter(job=job, event="round_started", meta__round=2).exists()
    connection.close()


def test_flow_rounds_over_http(processes, member_setup):
    alice = member_setup[0]
    base = processes.simllm(latency_ms=20)
    Executor.objects.filter(name="shared").update(enabled=False)
    Executor.objects.create(name="llm", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["m"]})
    agent = flow(alice, "go [rounds:3]")
    translate = job_submit(
        user=alice,
        team="a",
        type="translate",
        requirements={"model": "m"},
        input={"text": "hello", "target_lang": "French", "source_lang": "English"},
    )
    processes.worker("w", concurrency=4)
    agent, translate = ended(agent, translate)

    assert (agent.status, agent.rounds) == ("done", 3)
    assert agent.conversation[0]["tool_calls"][0]["function"] == {"name": "echo", "arguments": '{"round": 1}'}
    assert agent.result["message"]["content"].startswith("[simulated by simllm]")
    assert translate.status == "done" and translate.result["text"].startswith("[simulated by simllm]")
    assert http_json(f"{base}/stats")["jobs"] == {str(agent.pk): 3, str(translate.pk): 1}
    connection.close()


def test_a_flow_runs_no_tool_while_tools_are_switched_off(processes, member_setup, toolbox, operator):
    # Given tools switched off for team a, and a flow whose model calls a tool...
    alice, _, team_a, _, executor = member_setup
    Executor.objects.filter(pk=executor.pk).update(meta={"latency_ms": 10})
    feature_set(feature="tool", team=team_a, enabled=False, by=operator)
    agent = flow(alice, "plan [rounds:3]", tools=("echo",))
    # When a worker runs it...
    processes.worker("w", concurrency=4, TELEMACHUS_TOOLS=TOOLBOX)
    (agent,) = ended(agent)
    # Then the tool never ran: the flow failed at its first round's tools, saying why.
    assert agent.status == "failed" and "the tool feature is switched off" in agent.error
    queued = JobEvent.objects.filter(job=agent, event="queued", meta__round__gte=2)
    assert not queued.exists(), "no second round"
