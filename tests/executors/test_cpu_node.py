"""The cpu-node executor: registered tasks run in a real process pool, errors say what went wrong,
cancel stops a running task, and (with a real worker process) task jobs run under the executor's
own capacity without any change to the scheduler."""

import asyncio
import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import Count

from executors.contract import DispatchError, DispatchRequest, DispatchResult
from executors.drivers.cpu import CpuNodeDriver
from executors.models import Executor
from executors.tasks import UnknownTask, task_resolve
from scheduler.models import Job
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from tests.processes import wait_until

MODULE = __name__

# --- tasks a deployment might register (module-level, so a pool process can import them) --------


def multiply(a: float, b: float) -> float:
    return a * b


def mark_and_sleep(marker: str, seconds: float) -> int:
    """Leave a file naming this process (so a test knows the task is running), then sleep.

    The file appears whole, by rename: a test that sees it exist must never read it half written.
    """
    partial = Path(f"{marker}.{os.getpid()}.partial")
    partial.write_text(str(os.getpid()))
    partial.replace(marker)
    time.sleep(seconds)
    return os.getpid()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


not_importable_by_name = lambda: None  # noqa: E731  (the mistake under test: a lambda has no importable name)


# --- helpers ------------------------------------------------------------------------------------


def request(callable: str, *args, job_id: int = 1, type: str = "task", **kwargs) -> DispatchRequest:
    return DispatchRequest(
        job_id=job_id, type=type, model="cpu", input={"callable": callable, "args": list(args), "kwargs": kwargs}
    )


def dispatch(driver: CpuNodeDriver, req: DispatchRequest) -> DispatchResult:
    return asyncio.run(driver.dispatch(req))


def dispatch_error(driver: CpuNodeDriver, req: DispatchRequest) -> DispatchError:
    with pytest.raises(DispatchError) as caught:
        dispatch(driver, req)
    return caught.value


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an interval that ends as another starts does not overlap it)."""
    edges = sorted(
        [(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
        key=lambda edge: (edge[0], edge[1]),
    )
    open_now = peak = 0
    for _, step in edges:
        open_now += step
        peak = max(peak, open_now)
    return peak


@pytest.fixture
def make_driver():
    """Drivers on unsaved executor rows (a driver never touches the database); pools shut at the end."""
    drivers = []

    def make(max_concurrency: int = 2) -> CpuNodeDriver:
        driver = CpuNodeDriver(Executor(name=f"cpu-{len(drivers)}", kind="cpu-node", max_concurrency=max_concurrency))
        drivers.append(driver)
        return driver

    yield make
    for driver in drivers:
        asyncio.run(driver.aclose())


# --- the driver -----------------------------------------------------------------------------------


class TestDispatch:
    def test_runs_a_registered_task_in_another_process_and_returns_its_value(self, make_driver):
        driver = make_driver()

        result = dispatch(driver, request("telemachus.add", 1, 2, 3.5))
        slept = dispatch(driver, request("telemachus.sleep", 0))

        assert result.output["value"] == 6.5 and result.output["task"] == "telemachus.add"
        assert result.output["elapsed_s"] >= 0 and result.tokens_used == 0
        assert slept.output["value"]["pid"] != os.getpid()

    def test_sha256_hashes_the_given_number_of_rounds(self, make_driver):
        expected = b"telemachus"
        for _ in range(1000):
            expected = hashlib.sha256(expected).digest()

        result = dispatch(make_driver(), request("telemachus.sha256", "telemachus", rounds=1000))

        assert result.output["value"] == expected.hex()

    def test_an_unknown_task_is_not_retryable_and_names_the_registered_ones(self, make_driver):
        error = dispatch_error(make_driver(), request("nope.missing"))

        assert not error.retryable and not error.executor_fault
        assert str(error).startswith("unknown task 'nope.missing'; registered tasks: telemachus.add")

    def test_bad_arguments_are_refused_before_the_pool_is_used(self, make_driver):
        driver = make_driver()

        error = dispatch_error(driver, request("telemachus.sha256", txt="x"))

        assert not error.retryable
        assert str(error) == "bad arguments for task 'telemachus.sha256': missing a required argument: 'text'"
        assert driver._pool is None

    @pytest.mark.parametrize(
        ("req", "message"),
        [
            (
                DispatchRequest(job_id=1, type="task", model="cpu", input={"args": [1]}),
                'a task job\'s input must be {"callable": "<task name>", "args": [...], "kwargs": {...}}',
            ),
            (
                DispatchRequest(job_id=1, type="task", model="cpu", input={"callable": "telemachus.add", "args": 1}),
                'a task job\'s input must be {"callable": "<task name>", "args": [...], "kwargs": {...}}',
            ),
            (
                DispatchRequest(job_id=1, type="chat", model="cpu", input={"messages": []}),
                "cpu-0 is a cpu-node executor: it runs task jobs, not 'chat'",
            ),
        ],
    )
    def test_input_that_is_not_a_task_call_is_not_retryable(self, make_driver, req, message):
        error = dispatch_error(make_driver(), req)

        assert not error.retryable and str(error) == message

    def test_an_exception_inside_the_task_gives_its_type_and_message(self, make_driver):
        error = dispatch_error(make_driver(), request("telemachus.add", 1, "two"))

        assert not error.retryable
        assert str(error) == "task 'telemachus.add' raised TypeError: add takes numbers, not str"

    def test_an_exception_inside_the_task_is_stored_with_its_class_and_traceback(self, make_driver):
        error = dispatch_error(make_driver(), request("telemachus.add", 1, "two"))

        assert error.detail["exception_class"] == "builtins.TypeError"
        assert "TypeError: add takes numbers, not str" in error.detail["traceback"]

    def test_a_value_that_is_not_json_is_refused(self, make_driver, settings):
        settings.TELEMACHUS_TASKS = ["test.set=builtins.set", "test.float=builtins.float"]
        driver = make_driver()

        not_json = dispatch_error(driver, request("test.set", [1, 2]))
        nan = dispatch_error(driver, request("test.float", "nan"))

        assert not not_json.retryable and not nan.retryable
        assert str(not_json) == (
            "task 'test.set' returned a value that is not JSON-serialisable: "
            "Object of type set is not JSON serializable"
        )
        assert str(nan).startswith(
            "task 'test.float' returned a value that is not JSON-serialisable: Out of range float"
        )


class TestRegistry:
    def test_a_task_added_through_settings_runs(self, make_driver, settings):
        settings.TELEMACHUS_TASKS = [f"test.multiply={MODULE}.multiply"]

        result = dispatch(make_driver(), request("test.multiply", 6, b=7))

        assert result.output == {"value": 42, "task": "test.multiply", "elapsed_s": result.output["elapsed_s"]}

    def test_the_setting_is_read_on_every_lookup(self, settings):
        settings.TELEMACHUS_TASKS = [f"test.multiply={MODULE}.multiply"]
        assert task_resolve(name="test.multiply") is multiply

        settings.TELEMACHUS_TASKS = []
        with pytest.raises(UnknownTask):
            task_resolve(name="test.multiply")

    @pytest.mark.parametrize(
        ("entry", "message"),
        [
            ("test.multiply", "TELEMACHUS_TASKS entry 'test.multiply' is not name=dotted.path.function"),
            ("=tests.x", "TELEMACHUS_TASKS entry '=tests.x' is not name=dotted.path.function"),
            (
                "test.x=no_such_module.fn",
                "task 'test.x': cannot import no_such_module.fn: No module named 'no_such_module'",
            ),
            ("test.x=executors.tasks.BUILTIN_TASKS", "task 'test.x': executors.tasks.BUILTIN_TASKS is not callable"),
            (
                f"test.x={MODULE}.not_importable_by_name",
                f"task 'test.x': {MODULE}.not_importable_by_name cannot be sent to a pool process; "
                "register a module-level function",
            ),
        ],
    )
    def test_a_broken_entry_is_a_configuration_error_and_a_failed_job(self, make_driver, settings, entry, message):
        settings.TELEMACHUS_TASKS = [entry]

        with pytest.raises(ImproperlyConfigured) as caught:
            task_resolve(name="test.x")
        error = dispatch_error(make_driver(), request("test.x"))

        assert str(caught.value).startswith(message)
        assert str(error).startswith(message) and not error.retryable


class TestDeclaredTasks:
    """Tasks declared with Django's tasks API, named by dotted path (tests/scheduler/declared_tasks.py)."""

    def test_a_declared_task_runs_by_its_dotted_path(self, make_driver):
        result = dispatch(make_driver(), request("tests.scheduler.declared_tasks.add", 2, b=5))

        assert result.output["value"] == 7 and result.output["task"] == "tests.scheduler.declared_tasks.add"

    def test_its_arguments_are_checked_against_the_function(self, make_driver):
        error = dispatch_error(make_driver(), request("tests.scheduler.declared_tasks.add", 2, b=1, c=5))

        assert str(error) == (
            "bad arguments for task 'tests.scheduler.declared_tasks.add': got an unexpected keyword argument 'c'"
        )

    def test_a_function_that_is_not_a_task_does_not_run(self, make_driver):
        error = dispatch_error(make_driver(), request("tests.scheduler.declared_tasks.not_a_task"))

        assert not error.retryable
        assert str(error) == "tests.scheduler.declared_tasks.not_a_task is not a task declared with Django's @task"

    def test_a_path_outside_the_installed_apps_is_never_imported(self, make_driver):
        assert "antigravity" not in sys.modules

        error = dispatch_error(make_driver(), request("antigravity.fly"))

        assert str(error).startswith("unknown task 'antigravity.fly'; registered tasks:")
        assert "antigravity" not in sys.modules


class TestPool:
    def test_no_more_tasks_run_at_once_than_max_concurrency(self, make_driver):
        driver = make_driver(max_concurrency=2)

        async def four_sleeps() -> list[DispatchResult]:
            return await asyncio.gather(*(driver.execute(request("telemachus.sleep", 0.5, job_id=i)) for i in range(4)))

        values = [result.output["value"] for result in asyncio.run(four_sleeps())]

        assert max_overlap([(v["started"], v["finished"]) for v in values]) == 2
        assert len({v["pid"] for v in values}) == 2

    def test_cancel_kills_the_running_task_and_runs_its_neighbour_again(self, make_driver, settings, tmp_path):
        settings.TELEMACHUS_TASKS = [f"test.mark_and_sleep={MODULE}.mark_and_sleep"]
        driver = make_driver(max_concurrency=2)
        long_marker, short_marker = tmp_path / "long", tmp_path / "short"

        async def scenario() -> tuple[int, float, DispatchResult]:
            long = asyncio.create_task(driver.execute(request("test.mark_and_sleep", str(long_marker), 600, job_id=1)))
            short = asyncio.create_task(driver.execute(request("test.mark_and_sleep", str(short_marker), 1, job_id=2)))
            while not (long_marker.exists() and short_marker.exists()):
                await asyncio.sleep(0.02)
            first_short_pid = int(short_marker.read_text())
            short_marker.unlink()
            started = time.monotonic()
            assert await driver.cancel(1)
            with pytest.raises(asyncio.CancelledError):
                await long
            return first_short_pid, time.monotonic() - started, await short

        first_short_pid, cancelled_in, short = asyncio.run(scenario())

        assert cancelled_in < 1
        wait_until(
            lambda: not alive(int(long_marker.read_text())), timeout=10, what="the cancelled task's process to exit"
        )
        # The neighbour was running in the killed pool: it started again from the beginning, in a new process.
        assert short_marker.exists() and short.output["value"] != first_short_pid

    def test_a_pool_process_that_dies_is_retryable_and_the_pool_is_rebuilt(self, make_driver, settings):
        settings.TELEMACHUS_TASKS = [f"test.die={MODULE}.die"]
        driver = make_driver()

        error = dispatch_error(driver, request("test.die"))
        after = dispatch(driver, request("telemachus.add", 2, 2))

        assert error.retryable and error.executor_fault
        assert str(error).startswith("cpu-0: a pool process died while the task was running or queued")
        assert after.output["value"] == 4

    def test_aclose_stops_the_pool_processes(self, make_driver):
        driver = make_driver()
        pid = dispatch(driver, request("telemachus.sleep", 0)).output["value"]["pid"]

        asyncio.run(driver.aclose())

        wait_until(lambda: not alive(pid), timeout=10, what="the pool process to exit")
        assert driver._pool is None


# --- with a real worker process -----------------------------------------------------------------


def submit_task(user, callable: str, *args, **kwargs) -> Job:
    return job_submit(
        user=user,
        team="a",
        type="task",
        requirements={"model": "cpu"},
        input={"callable": callable, "args": list(args), "kwargs": kwargs},
    )


@pytest.fixture
def cpu_node(make_user, make_team):
    """Given alice in team a and a cpu-node executor with two slots of its own."""
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    executor = Executor.objects.create(
        name="cpu-1", kind="cpu-node", capabilities={"models": ["cpu"]}, max_concurrency=2
    )
    return alice, executor


def statuses() -> dict[str, int]:
    return dict(Job.objects.values_list("status").annotate(n=Count("id")))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
class TestWithAWorkerProcess:
    def test_task_jobs_run_to_done_no_more_than_two_at_once(self, processes, cpu_node):
        alice, executor = cpu_node
        sleeps = [submit_task(alice, "telemachus.sleep", 1) for _ in range(4)]
        added = submit_task(alice, "telemachus.add", 1, 2, 3)
        hashed = submit_task(alice, "telemachus.sha256", "abc", rounds=2)

        processes.worker("w", concurrency=8)
        wait_until(lambda: statuses() == {"done": 6}, timeout=60, interval=0.2, what="6 task jobs done")

        jobs = {job.pk: job for job in Job.objects.all()}
        assert {job.executor_id for job in jobs.values()} == {executor.pk}
        assert jobs[added.pk].result["value"] == 6 and jobs[added.pk].tokens_used == 0
        assert jobs[hashed.pk].result["value"] == hashlib.sha256(hashlib.sha256(b"abc").digest()).hexdigest()
        ran = [jobs[job.pk].result["value"] for job in sleeps]
        assert max_overlap([(v["started"], v["finished"]) for v in ran]) == 2
        assert len({v["pid"] for v in ran}) <= 2
        connection.close()

    def test_cancel_stops_a_running_task_and_frees_its_process(self, processes, cpu_node, tmp_path):
        alice, _ = cpu_node
        marker = tmp_path / "slow"
        processes.start(
            "w",
            "scheduler_worker",
            "--name",
            "w",
            "--concurrency",
            "8",
            TELEMACHUS_TASKS=f"test.mark_and_sleep={MODULE}.mark_and_sleep",
        )
        slow = submit_task(alice, "test.mark_and_sleep", str(marker), 600)
        wait_until(marker.exists, timeout=30, what="the slow task to start in a pool process")

        job_cancel(job_id=slow.pk)
        wait_until(lambda: not alive(int(marker.read_text())), timeout=10, what="the cancelled task's process to exit")
        pair = [submit_task(alice, "telemachus.sleep", 1) for _ in range(2)]
        wait_until(
            lambda: statuses() == {"canceled": 1, "done": 2}, timeout=30, interval=0.2, what="two more jobs done"
        )

        ran = [Job.objects.get(pk=job.pk).result["value"] for job in pair]
        assert max_overlap([(v["started"], v["finished"]) for v in ran]) == 2  # both slots are usable again
        assert "killing a process pool to stop a cancelled task" in processes.procs[-1].log_path.read_text()
        connection.close()

    def test_pool_processes_exit_when_their_worker_is_killed(self, processes, cpu_node, tmp_path):
        alice, _ = cpu_node
        marker = tmp_path / "running"
        worker = processes.start(
            "w",
            "scheduler_worker",
            "--name",
            "w",
            "--concurrency",
            "8",
            TELEMACHUS_TASKS=f"test.mark_and_sleep={MODULE}.mark_and_sleep",
        )
        submit_task(alice, "test.mark_and_sleep", str(marker), 600)
        wait_until(marker.exists, timeout=30, what="the task to start in a pool process")

        worker.send_signal(signal.SIGKILL)

        wait_until(lambda: not alive(int(marker.read_text())), timeout=10, what="the orphaned pool process to exit")
        connection.close()
