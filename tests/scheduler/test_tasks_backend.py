"""Django's tasks API on Telemachus: tasks enqueued with the standard API become governed `task`
jobs, run on a cpu-node executor by a real worker process, and read back through the same API."""

import asyncio
import math
import sys
import time
import types
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, connections
from django.utils import timezone

from executors.models import Executor
from quotas.services import quota_policy_create
from scheduler.models import Job, JobEvent, QueuePolicy, Slot
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.finish import Outcome, jobs_finish
from scheduler.services.policy import queue_policy_update
from scheduler.services.submit import job_submit
from scheduler.tasks_backend import JobCanceled, JobFailed, TelemachusBackend, enqueue_as
from telemachus.errors import UnknownModel
from telemachus.models import Team
from telemachus.tasks_api import (
    InvalidTask,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    task,
    task_backends,
)
from telemachus.teams.services import team_member_set
from tests.executors.test_cpu_node import alive, max_overlap
from tests.processes import wait_until
from tests.scheduler import declared_tasks
from tests.scheduler.declared_tasks import Unlucky, add, double_later, fail, introspect, nap

BACKEND = "scheduler.tasks_backend.TelemachusBackend"


def tasks_setting(**options) -> dict:
    return {"default": {"BACKEND": BACKEND, "OPTIONS": {"team": "a", **options}}}


@pytest.fixture
def alice(make_user, make_team, settings):
    """Given alice in team a (which grants its members flows:run), a cpu-node executor with four
    slots offering model `cpu`, and the default tasks backend submitting into team a."""
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    Executor.objects.create(name="cpu-1", kind="cpu-node", capabilities={"models": ["cpu"]}, max_concurrency=4)
    settings.TASKS = tasks_setting()
    return alice


def finished(result: TaskResult) -> bool:
    result.refresh()
    return result.is_finished


# --- enqueue: what maps onto a job -------------------------------------------------------------


class TestEnqueue:
    def test_a_task_becomes_a_queued_task_job_of_the_principal(self, alice):
        with enqueue_as(user=alice):
            result = add.enqueue(2, b=3)

        job = Job.objects.get(pk=int(result.id))
        assert (job.type, job.status, job.user, job.team.slug) == ("task", "queued", alice, "a")
        assert job.requirements == {"model": "cpu"}
        assert job.input == {
            "callable": "tests.scheduler.declared_tasks.add",
            "args": [2],
            "kwargs": {"b": 3},
            "backend": "default",
        }
        assert job.meta == {"queue_name": "default"} and job.run_after is None
        assert result.status == TaskResultStatus.READY and not result.is_finished
        assert (result.args, result.kwargs, result.backend) == ([2], {"b": 3}, "default")
        assert result.enqueued_at == job.submitted_at and result.started_at is None and result.attempts == 0

    def test_the_service_user_and_team_come_from_options_and_the_context_overrides_the_team(
        self, alice, make_user, make_team, settings
    ):
        bot = make_user("tasks-bot")
        team_member_set(team=Team.objects.get(slug="a"), username="tasks-bot", role="member")
        make_team("b", {bot: "member", alice: "member"})
        settings.TASKS = tasks_setting(user="tasks-bot")

        by_bot = add.enqueue(1, 1)
        with enqueue_as(team="b"):
            bot_in_b = add.enqueue(1, 1)
        with enqueue_as(user=alice, team="b"):
            alice_in_b = add.enqueue(1, 1)

        jobs = Job.objects.in_bulk([int(r.id) for r in (by_bot, bot_in_b, alice_in_b)])
        assert [(jobs[int(r.id)].user.username, jobs[int(r.id)].team.slug) for r in (by_bot, bot_in_b, alice_in_b)] == [
            ("tasks-bot", "a"),
            ("tasks-bot", "b"),
            ("alice", "b"),
        ]

    def test_a_backend_alias_per_team_chooses_the_team_with_using(self, alice, make_team, settings):
        make_team("b", {alice: "member"})
        settings.TASKS = {**tasks_setting(), "team-b": {"BACKEND": BACKEND, "OPTIONS": {"team": "b"}}}

        with enqueue_as(user=alice):
            result = add.using(backend="team-b").enqueue(1, 2)

        assert Job.objects.get(pk=int(result.id)).team.slug == "b"
        assert result.backend == "team-b" and task_backends["team-b"].get_result(result.id).id == result.id

    def test_priority_run_after_and_queue_map_onto_the_job(self, alice, settings):
        settings.TASKS = {
            "default": {
                "BACKEND": BACKEND,
                "OPTIONS": {
                    "team": "a",
                    "queues": {"default": {"model": "cpu"}, "big": {"model": "cpu", "memory_mb": 8192}},
                },
            }
        }
        later = timezone.now() + timedelta(hours=1)

        with enqueue_as(user=alice):
            result = add.using(priority=7, run_after=later, queue_name="big").enqueue(1, 2)

        job = Job.objects.get(pk=int(result.id))
        assert (job.priority, job.run_after, job.meta["queue_name"]) == (7, later, "big")
        # Its place in line and its ageing start when it may run, not when it was enqueued.
        assert job.ready_at == job.queued_at == later
        assert job.requirements == {"model": "cpu", "memory_mb": 8192}
        assert JobEvent.objects.get(job=job, event="queued").meta["run_after"] == later.isoformat()
        read = add.get_result(result.id)
        assert (read.task.priority, read.task.run_after, read.task.queue_name) == (7, later, "big")

    def test_a_priority_above_the_ceiling_is_clamped_when_the_policy_says_so(self, alice):
        queue_policy_update(changes={"priority_map": {"member": 3}}, by=None)

        with enqueue_as(user=alice):
            result = add.using(priority=9).enqueue(1, 2)

        job = Job.objects.get(pk=int(result.id))
        assert job.priority == result.task.priority == 3
        assert JobEvent.objects.get(job=job, event="priority_clamped").meta["requested"] == 9

    def test_the_submit_checks_still_apply(self, alice, make_user, settings):
        stranger = make_user("stranger")
        queue_policy_update(
            changes={"priority_map": {"member": 0}, "priority_over_limit": QueuePolicy.OverLimit.REJECT}, by=None
        )

        with enqueue_as(user=stranger), pytest.raises(InvalidTask, match="No team 'a' that you belong to"):
            add.enqueue(1, 2)
        with enqueue_as(user=alice), pytest.raises(InvalidTask, match="At most 0 for you in team 'a'"):
            add.using(priority=5).enqueue(1, 2)
        settings.TASKS = tasks_setting(queues={"default": {"model": "gpu-only"}})
        with enqueue_as(user=alice), pytest.raises(UnknownModel, match="offers model 'gpu-only'"):
            add.enqueue(1, 2)
        assert not Job.objects.exists()


class TestRefused:
    """What does not map onto a job is refused at enqueue, and nothing is written."""

    @pytest.mark.parametrize(
        ("args", "kwargs", "message"),
        [
            (
                (datetime(2025, 1, 1, tzinfo=UTC),),
                {},
                r"Task args\[0\] must be JSON, not datetime datetime.datetime\(2025",
            ),
            ((1,), {"b": {1, 2}}, r"Task kwargs\['b'\] must be JSON, not set \{1, 2\}; pass what the task needs"),
            ((1,), {"b": [b"raw"]}, r"Task kwargs\['b'\]\[0\] must be JSON, not bytes b'raw'"),
            ((math.nan, 1), {}, r"Task args\[0\] must be JSON: nan is not a JSON number"),
            (({1: "x"}, 1), {}, r"Task args\[0\] must be JSON: key 1 is not a string"),
        ],
    )
    def test_arguments_that_are_not_json(self, alice, args, kwargs, message):
        with enqueue_as(user=alice), pytest.raises(InvalidTask, match=message):
            add.enqueue(*args, **kwargs)
        assert not Job.objects.exists()

    def test_tuples_travel_as_lists(self, alice):
        with enqueue_as(user=alice):
            result = add.enqueue((1, 2), b=("x",))

        assert Job.objects.get(pk=int(result.id)).input["args"] == [[1, 2]] and result.kwargs == {"b": ["x"]}

    def test_a_queue_without_requirements(self, alice, settings):
        settings.TASKS = {"default": {"BACKEND": BACKEND, "QUEUES": ["default", "gpu"], "OPTIONS": {"team": "a"}}}

        with pytest.raises(InvalidTask, match="Queue 'gpu' has no requirements in TASKS\\['default'\\]"):
            add.using(queue_name="gpu")
        with pytest.raises(InvalidTask, match="Queue 'nowhere' is not valid for backend"):
            add.using(queue_name="nowhere")
        assert [e.id for e in task_backends["default"].check()] == ["telemachus.E001"]

    def test_a_task_outside_the_installed_apps(self, alice, settings):
        settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "tests"]

        with enqueue_as(user=alice), pytest.raises(InvalidTask, match="is not in an installed app"):
            add.enqueue(1, 2)

    def test_a_task_not_reachable_by_its_name(self, alice):
        # A Task made from a function that stays a plain function in its module: workers find by the
        # dotted path a plain function, which they must refuse to run.
        shadow = type(add)(
            priority=0, func=declared_tasks.not_a_task, backend="default", queue_name="default", run_after=None
        )

        with enqueue_as(user=alice), pytest.raises(InvalidTask, match="not_a_task is not a task declared with"):
            shadow.enqueue()

    def test_no_team_or_no_user(self, alice, settings):
        settings.TASKS = {"default": {"BACKEND": BACKEND}}
        with pytest.raises(ImproperlyConfigured, match=r"No team to submit the task into: enqueue inside enqueue_as"):
            add.enqueue(1, 2)
        with enqueue_as(team="a"), pytest.raises(ImproperlyConfigured, match="No user to submit the task as"):
            add.enqueue(1, 2)
        settings.TASKS = tasks_setting(user="ghost")
        with pytest.raises(ImproperlyConfigured, match="names no user: 'ghost'"):
            add.enqueue(1, 2)

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"teams": "a"}, r"has unknown keys \['teams'\]"),
            ({"queues": {"default": {"modle": "cpu"}}}, r"\['queues'\]\['default'\] is not a job's requirements"),
            ({"queues": {}}, "must map queue names to requirements"),
        ],
    )
    def test_bad_options_are_a_configuration_error(self, options, message):
        with pytest.raises(ImproperlyConfigured, match=message):
            TelemachusBackend("broken", {"OPTIONS": options})


class TestGetResult:
    def test_ids_that_are_not_task_results(self, alice, make_executor):
        backend = task_backends["default"]
        make_executor("model-server", models=["m"])  # a cpu-node's `cpu` takes no chat
        chat = job_submit(
            user=alice,
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
        registered = job_submit(
            user=alice,
            team="a",
            type="task",
            requirements={"model": "cpu"},
            input={"callable": "telemachus.add", "args": [1], "kwargs": {}},
        )

        for result_id in ("nope", "999999", str(chat.pk), str(registered.pk)):
            with pytest.raises(TaskResultDoesNotExist):
                backend.get_result(result_id)

    def test_a_result_is_read_in_two_queries(self, alice, django_assert_num_queries):
        with enqueue_as(user=alice):
            result = add.enqueue(1, 2)

        with django_assert_num_queries(2):  # the job, its start, retry and cancel events
            result.refresh()

    def test_a_retry_keeps_the_first_start_and_moves_the_last_attempt(self, alice):
        with enqueue_as(user=alice):
            result = add.enqueue(1, 2)
        (claim,) = job_claim(worker="w1", limit=1).claims
        jobs_finish(
            outcomes=[Outcome(job_id=claim.job.pk, lease=claim.lease, ok=False, error="pool died", retryable=True)]
        )
        Job.objects.filter(pk=claim.job.pk).update(run_after=None)
        first = Job.objects.get(pk=claim.job.pk).started_at
        time.sleep(0.01)
        job_claim(worker="w2", limit=1)

        result.refresh()
        assert result.attempts == 2 and result.worker_ids == ["w1", "w2"]
        assert result.started_at == first and result.last_attempted_at > first

    @pytest.mark.django_db(transaction=True)
    def test_aenqueue_and_aget_result_keep_the_submitter(self, alice):
        async def enqueue_and_read() -> tuple[TaskResult, TaskResult]:
            with enqueue_as(user=alice):
                result = await add.aenqueue(4, 5)
            read = await add.aget_result(result.id)
            await sync_to_async(connections.close_all)()  # the connection of asgiref's thread
            return result, read

        result, read = asyncio.run(enqueue_and_read())

        assert Job.objects.get(pk=int(result.id)).user == alice
        assert (read.id, read.status, read.args) == (result.id, TaskResultStatus.READY, [4, 5])

    def test_a_result_read_through_another_task_is_a_mismatch(self, alice):
        with enqueue_as(user=alice):
            result = add.enqueue(1, 2)

        with pytest.raises(TaskResultMismatch):
            fail.get_result(result.id)

    @pytest.mark.django_db(transaction=True)
    def test_priority_orders_the_claim(self, alice):
        Executor.objects.filter(name="cpu-1").update(max_concurrency=1)
        with enqueue_as(user=alice):
            low = add.using(priority=-5).enqueue(1, 1)
            high = add.using(priority=7).enqueue(2, 2)
            later = add.using(priority=50, run_after=timezone.now() + timedelta(hours=1)).enqueue(3, 3)

        claimed = job_claim(worker="w-test", limit=5).claims

        assert [str(claim.job.pk) for claim in claimed] == [high.id]  # one slot; the deferred one waits
        high.refresh(), low.refresh(), later.refresh()
        assert high.status == TaskResultStatus.RUNNING and high.worker_ids == ["w-test"] and high.attempts == 1
        assert high.started_at is not None and high.last_attempted_at == high.started_at
        assert low.status == later.status == TaskResultStatus.READY


# --- with a real worker process -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
class TestWithAWorkerProcess:
    def test_success_exception_context_and_async_read_back_through_the_api(self, alice, processes):
        with enqueue_as(user=alice):
            summed = add.enqueue(2, b=3)
            failed = fail.enqueue("no luck today")
            bad_call = add.enqueue(1)  # missing b: fails outside the task body
            context = introspect.enqueue("hello")
            doubled = double_later.enqueue(21)
        results = [summed, failed, bad_call, context, doubled]

        processes.worker("w", concurrency=8)
        wait_until(lambda: all(finished(r) for r in results), timeout=60, interval=0.2, what="5 tasks finished")

        assert summed.status == TaskResultStatus.SUCCESSFUL and summed.return_value == 5
        assert summed.errors == [] and summed.worker_ids == ["w"] and summed.attempts == 1
        assert summed.enqueued_at <= summed.started_at <= summed.finished_at
        assert doubled.return_value == 42

        assert failed.status == TaskResultStatus.FAILED and len(failed.errors) == 1
        error = failed.errors[0]
        assert error.exception_class is Unlucky
        assert error.exception_class_path == "tests.scheduler.declared_tasks.Unlucky"
        assert "raise Unlucky(message)" in error.traceback and "Unlucky: no luck today" in error.traceback
        with pytest.raises(ValueError, match="Task failed"):
            _ = failed.return_value

        assert bad_call.status == TaskResultStatus.FAILED and bad_call.errors[0].exception_class is JobFailed
        assert "bad arguments for task 'tests.scheduler.declared_tasks.add'" in bad_call.errors[0].traceback

        assert context.return_value == {
            "id": context.id,
            "status": "RUNNING",
            "attempt": 1,
            "tag": "hello",
            "workers": ["w"],
        }
        connection.close()

    def test_cancel_stops_the_task_and_reads_as_failed(self, alice, processes, tmp_path):
        marker = tmp_path / "napping"
        with enqueue_as(user=alice):
            result = nap.enqueue(600, marker=str(marker))
        processes.worker("w", concurrency=8)
        wait_until(marker.exists, timeout=30, what="the task to start in a pool process")
        result.refresh()
        assert result.status == TaskResultStatus.RUNNING and not result.is_finished

        job_cancel(job_id=int(result.id), by=alice)
        result.refresh()

        assert result.status == TaskResultStatus.FAILED and result.is_finished
        assert [e.exception_class for e in result.errors] == [JobCanceled]
        assert result.errors[0].traceback == f"job {result.id} was canceled by alice"
        wait_until(lambda: not alive(int(marker.read_text())), timeout=10, what="the cancelled task's process to exit")
        connection.close()

    def test_run_after_holds_a_task_back_until_its_time(self, alice, processes):
        not_before = timezone.now() + timedelta(seconds=4)
        with enqueue_as(user=alice):
            deferred = add.using(run_after=not_before).enqueue(1, 1)
            prompt = add.enqueue(2, 2)
        processes.worker("w", concurrency=8)

        wait_until(lambda: finished(prompt), timeout=60, interval=0.1, what="the prompt task")
        deferred.refresh()
        if timezone.now() < not_before:
            assert deferred.status == TaskResultStatus.READY
        wait_until(lambda: finished(deferred), timeout=60, interval=0.2, what="the deferred task")

        assert deferred.return_value == 2 and deferred.started_at >= not_before
        connection.close()

    def test_a_team_cap_of_two_holds_for_tasks(self, alice, processes):
        quota_policy_create(scope="team", subject="a", dimension="ai.concurrency", limit=2)
        with enqueue_as(user=alice):
            results = [nap.enqueue(1.0) for _ in range(6)]
        processes.worker("w", concurrency=8)

        seen: list[tuple[int, int]] = []  # (slots held by team a, its running jobs), sampled from the database
        deadline = time.monotonic() + 90
        while not all(finished(r) for r in results):
            assert time.monotonic() < deadline, "timed out waiting for 6 tasks"
            seen.append(
                (
                    Slot.objects.filter(team__slug="a").count(),
                    Job.objects.filter(team__slug="a", status="running").count(),
                )
            )
            time.sleep(0.05)

        assert {r.status for r in results} == {TaskResultStatus.SUCCESSFUL}
        assert max(slots for slots, _ in seen) == 2 and max(running for _, running in seen) == 2
        assert max_overlap([(r.return_value["started"], r.return_value["finished"]) for r in results]) == 2
        connection.close()


class TestRefusedBeforeAWorkerSeesIt:
    """A task a worker could not import is refused at enqueue, with nothing written, rather than
    failing every attempt in the worker."""

    def test_a_module_that_exists_only_in_this_process(self, alice, monkeypatch):
        module = types.ModuleType("tests.scheduler.made_at_run_time")
        exec("def work(a):\n    return a\n", module.__dict__)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        module.work = task(module.work)

        with (
            enqueue_as(user=alice),
            pytest.raises(
                InvalidTask,
                match=(
                    r"tests.scheduler.made_at_run_time.work: module tests.scheduler.made_at_run_time is not importable "
                    r"from a file, so workers could not find it"
                ),
            ),
        ):
            module.work.enqueue(1)
        assert not Job.objects.exists()

    def test_a_function_that_is_not_module_level(self, alice):
        def inner(a: int) -> int:
            return a

        with pytest.raises(InvalidTask, match="Task function must be defined at a module level"):
            task(inner)
        with pytest.raises(InvalidTask, match="Task function must be defined at a module level"):
            type(add)(priority=0, func=inner, backend="default", queue_name="default", run_after=None).enqueue(1)
        assert not Job.objects.exists()

    def test_declared_tasks_still_pass(self, alice):
        with enqueue_as(user=alice):
            assert (
                Job.objects.get(pk=int(add.enqueue(1, 2).id)).input["callable"] == "tests.scheduler.declared_tasks.add"
            )
