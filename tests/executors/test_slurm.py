"""The hpc-partition executor against a real Slurm cluster (bin/slurm-test-cluster: Debian's
slurm-wlm and munge, one node, partition `debug`): task jobs run as batch jobs, errors say what
went wrong, cancel reaches scancel, health follows the partition's state, and (with real worker
processes) no more batch jobs are on the partition at once than the executor's max_concurrency.

Skipped without `sbatch`; when sbatch is there, the cluster must answer (CI starts it)."""

import asyncio
import json
import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Count

from executors.contract import DispatchError, DispatchRequest
from executors.drivers.slurm import Command, CommandTimeout, SlurmPartitionDriver, partition_health
from executors.models import Executor
from executors.slurmtransport import transport_problems
from scheduler.models import Job, JobEvent
from scheduler.services.cancel import job_cancel
from scheduler.services.submit import job_submit
from tests.executors.test_cpu_node import MODULE, max_overlap
from tests.processes import wait_until

PARTITION = "debug"
# bin/slurm-test-cluster keeps its configuration in a directory of its own (never /etc/slurm): Slurm's
# commands, here and in the worker processes the tests start, reach its cluster through SLURM_CONF.
TEST_CLUSTER_CONF = Path(os.environ.get("SLURM_TEST_DIR", "/var/lib/telemachus-slurm-test")) / "slurm.conf"
if "SLURM_CONF" not in os.environ and TEST_CLUSTER_CONF.exists():
    os.environ["SLURM_CONF"] = str(TEST_CLUSTER_CONF)
requires_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None,
    reason="needs Slurm's sbatch and a running cluster: run bin/slurm-test-cluster (installs slurm-wlm and munge)",
)


# --- helpers ------------------------------------------------------------------------------------


def request(callable: str, *args, job_id: int = 1, **kwargs) -> DispatchRequest:
    return DispatchRequest(
        job_id=job_id, type="task", model="hpc", input={"callable": callable, "args": list(args), "kwargs": kwargs}
    )


def batch_jobs(prefix: str) -> dict[str, str]:
    """Our batch jobs on the partition that Slurm still lists (pending, running or completing):
    Slurm job id -> state."""
    listed = subprocess.run(
        ["squeue", "-h", "-p", PARTITION, "-o", "%i %j %T"], capture_output=True, text=True, check=True
    ).stdout
    rows = (line.split() for line in listed.splitlines())
    return {job: state for job, name, state in rows if name.startswith(prefix)}


def slurm_state(slurm_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", "-o", slurm_id], capture_output=True, text=True)
    for field in shown.stdout.split():
        if field.startswith("JobState="):
            return field.partition("=")[2]
    return "GONE"


@pytest.fixture
def slurm_executor_name(request):
    """A name of its own per test and per run, and none of its batch jobs left behind. The batch
    jobs' names start with it, so squeue never counts a job of an earlier run (the same test on
    SQLite before PostgreSQL, a run that was killed) as this one's."""
    test = request.node.name[-40:].lower().replace("_", "-").strip("-")
    name = f"slurm-{test}-{secrets.token_hex(4)}"
    yield name
    left = batch_jobs(f"telemachus-{name}-")
    if left:
        subprocess.run(["scancel", *left], check=False)


@pytest.fixture
def make_driver(slurm_executor_name, tmp_path):
    drivers = []

    def make(max_concurrency: int = 2, **transport) -> SlurmPartitionDriver:
        transport = {"partition": PARTITION, "shared_dir": str(tmp_path / "shared"), **transport}
        row = Executor(
            name=slurm_executor_name, kind="hpc-partition", max_concurrency=max_concurrency, transport=transport
        )
        driver = SlurmPartitionDriver(row)
        drivers.append(driver)
        return driver

    yield make
    for driver in drivers:
        asyncio.run(driver.aclose())


# --- what the driver logs (no cluster needed: Slurm's commands answered by a fake) ----------------


def scripted_driver(*answers):
    """A driver whose Slurm commands answer `answers` in turn (a Command, or an exception to raise)."""
    driver = SlurmPartitionDriver(
        Executor(name="logs", kind="hpc-partition", max_concurrency=1, transport={"partition": PARTITION})
    )
    replies = list(answers)

    async def command(*argv: str) -> Command:
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    driver._command = command  # type: ignore[method-assign]
    return driver


def one_line_records(caplog) -> list[tuple[int, str]]:
    """The driver's log records as (level, message), each checked to hold no traceback."""
    records = [r for r in caplog.records if r.name == "telemachus.executors"]
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records), records
    return [(r.levelno, r.getMessage()) for r in records]


class TestLogs:
    """Expected conditions (a job Slurm forgot, a controller that does not answer, a task that
    raises) are one line at INFO or WARNING; tracebacks are for what nobody expected."""

    def test_a_job_the_controller_no_longer_knows_is_gone_without_a_word(self, caplog):
        driver = scripted_driver(Command(1, "", "slurm_load_jobs error: Invalid job id specified"))
        with caplog.at_level(logging.DEBUG, "telemachus.executors"):
            state = asyncio.run(driver._job_state("42"))
        assert state == ("GONE", "")
        assert one_line_records(caplog) == []

    def test_a_controller_that_does_not_answer_is_one_warning_per_query(self, caplog):
        driver = scripted_driver(
            Command(1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"),
            CommandTimeout("scontrol did not answer within 60s"),
        )
        with caplog.at_level(logging.DEBUG, "telemachus.executors"):
            states = [asyncio.run(driver._job_state("42")), asyncio.run(driver._job_state("42"))]
        assert states == [("", ""), ("", "")]
        ((level, message),) = one_line_records(caplog)
        assert level == logging.WARNING and "scontrol show job 42 failed: slurm_load_jobs error" in message

    def test_a_task_that_raised_is_one_info_line_and_its_traceback_stays_in_the_result(self, tmp_path, caplog):
        driver = scripted_driver()
        trace = 'Traceback (most recent call last):\n  File "tasks.py", line 3, in sha256\nValueError: secret-7\n'
        (tmp_path / "result.json").write_text(
            json.dumps(
                {
                    "ok": False,
                    "error": "raised ValueError",
                    "exception_class": "builtins.ValueError",
                    "traceback": trace,
                }
            )
        )
        with caplog.at_level(logging.DEBUG, "telemachus.executors"), pytest.raises(DispatchError) as caught:
            driver._outcome("telemachus.sha256", "42", "COMPLETED", "0:0", tmp_path)
        assert caught.value.detail == {"exception_class": "builtins.ValueError", "traceback": trace}
        ((level, message),) = one_line_records(caplog)
        assert (
            level == logging.INFO and message == "task 'telemachus.sha256' raised builtins.ValueError in batch job 42"
        )
        assert "secret-7" not in caplog.text


# --- the transport (no cluster needed) ------------------------------------------------------------


class TestTransport:
    @pytest.mark.parametrize(
        ("transport", "field"),
        [
            ({}, "partition"),
            ({"partition": "bad name"}, "partition"),
            ({"partition": "p", "sbatch_options": "--time=5"}, "sbatch_options"),
            ({"partition": "p", "sbatch_options": ["-t5"]}, "sbatch_options"),
            ({"partition": "p", "sbatch_options": ["--output=/tmp/x"]}, "sbatch_options"),
            ({"partition": "p", "sbatch_options": ["--array=1-100"]}, "sbatch_options"),
            ({"partition": "p", "shared_dir": "relative/dir"}, "shared_dir"),
            ({"partition": "p", "python": "python3"}, "python"),
            ({"partition": "p", "account": "x"}, "account"),
        ],
    )
    def test_malformed_fields_are_named(self, transport, field):
        assert field in transport_problems(transport)

    def test_a_complete_transport_passes(self):
        transport = {
            "partition": "gpu",
            "sbatch_options": ["--time=30", "--gres=gpu:1", "--account=ml"],
            "shared_dir": "/shared/telemachus",
            "python": "/opt/telemachus/.venv/bin/python",
        }
        assert transport_problems(transport) == {}

    @pytest.mark.django_db
    def test_the_api_refuses_a_partition_executor_without_a_partition(self, api, operator):
        body = {"name": "slurm-1", "kind": "hpc-partition", "capabilities": {"models": ["hpc"]}, "max_concurrency": 2}
        refused = api(operator).post(
            "/api/executors/", {**body, "transport": {"sbatch_options": ["--wrap=x"]}}, format="json"
        )
        assert refused.status_code == 400, refused.json()
        assert set(refused.json()["fields"]["transport"]) == {"partition", "sbatch_options"}
        created = api(operator).post("/api/executors/", {**body, "transport": {"partition": "debug"}}, format="json")
        assert created.status_code == 201, created.json()
        assert created.json()["kind"] == "hpc-partition"
        patched = api(operator).patch(
            f"/api/executors/{created.json()['id']}/", {"transport": {"partition": "a b"}}, format="json"
        )
        assert patched.status_code == 400 and list(patched.json()["fields"]["transport"]) == ["partition"]

    def test_the_admin_form_refuses_it_too(self):
        from django.core.exceptions import ValidationError

        row = Executor(name="slurm-1", kind="hpc-partition", transport={"partition": "debug", "python": "py"})
        with pytest.raises(ValidationError) as caught:
            row.clean()
        assert "transport.python" in str(caught.value)


class TestPartitionHealth:
    @pytest.mark.parametrize(
        ("sinfo", "health"),
        [
            ("up/idle\n", "ok"),
            ("up/mixed\nup/allocated\n", "ok"),
            ("up/idle~\n", "ok"),  # powered down: it boots for work
            ("up/idle\nup/drained\n", "degraded"),
            ("up/allocated\nup/idle*\n", "degraded"),  # one node does not respond
            ("up/drained\nup/down\n", "down"),
            ("down/idle\n", "down"),
            ("drain/idle\n", "down"),
            ("inact/idle\n", "down"),
            ("", "down"),  # no such partition
        ],
    )
    def test_the_partition_state_decides(self, sinfo, health):
        assert partition_health("p", sinfo).health == health


# --- the driver against the cluster ---------------------------------------------------------------


@pytest.mark.slurm
@requires_slurm
class TestDriver:
    def test_a_task_runs_as_a_batch_job_and_its_id_is_reported(self, make_driver):
        driver = make_driver()
        steps: list[dict] = []

        async def on_step(meta: dict) -> None:
            steps.append(meta)

        result = asyncio.run(driver.execute(request("telemachus.add", 1, 2, 3), on_step=on_step))

        assert result.output["value"] == 6 and result.output["task"] == "telemachus.add"
        assert result.tokens_used == 0
        assert [s["action"] for s in steps] == ["batch_submitted"] and steps[0]["partition"] == PARTITION
        assert slurm_state(steps[0]["slurm_job_id"]) == "COMPLETED"

    def test_an_exception_in_the_task_fails_with_its_class_and_traceback(self, make_driver):
        with pytest.raises(DispatchError) as caught:
            asyncio.run(make_driver().execute(request("telemachus.sha256", "abc", rounds=0)))
        assert "raised ValueError: rounds must be a positive integer" in str(caught.value)
        assert not caught.value.retryable
        assert caught.value.detail["exception_class"] == "builtins.ValueError"
        assert "in sha256" in caught.value.detail["traceback"]

    def test_an_unknown_task_is_refused_before_anything_is_submitted(self, make_driver, slurm_executor_name):
        steps: list[dict] = []

        async def on_step(meta: dict) -> None:
            steps.append(meta)

        with pytest.raises(DispatchError) as caught:
            asyncio.run(make_driver().execute(request("no.such.task"), on_step=on_step))
        assert "unknown task 'no.such.task'" in str(caught.value) and not caught.value.retryable
        assert steps == []

    def test_a_node_that_cannot_run_the_runner_fails_with_the_batch_jobs_output(self, make_driver):
        driver = make_driver(python="/nonexistent/python")
        with pytest.raises(DispatchError) as caught:
            asyncio.run(driver.execute(request("telemachus.add", 1)))
        message = str(caught.value)
        assert "without a result" in message and "/nonexistent/python" in message
        assert not caught.value.retryable and caught.value.executor_fault

    def test_a_batch_job_cancelled_outside_telemachus_is_retryable(self, make_driver, slurm_executor_name):
        driver = make_driver()

        async def scenario() -> DispatchError:
            running = asyncio.create_task(driver.execute(request("telemachus.sleep", 600, job_id=5)))
            while not (listed := batch_jobs(f"telemachus-{slurm_executor_name}-5")):
                await asyncio.sleep(0.1)
            subprocess.run(["scancel", *listed], check=True)
            with pytest.raises(DispatchError) as caught:
                await running
            return caught.value

        error = asyncio.run(scenario())
        assert "CANCELLED outside Telemachus" in str(error) and error.retryable and not error.executor_fault

    def test_cancel_scancels_the_running_batch_job(self, make_driver, slurm_executor_name):
        driver = make_driver()
        prefix = f"telemachus-{slurm_executor_name}-9"

        async def scenario() -> str:
            running = asyncio.create_task(driver.execute(request("telemachus.sleep", 600, job_id=9)))
            while "RUNNING" not in (listed := batch_jobs(prefix)).values():
                await asyncio.sleep(0.1)
            assert await driver.cancel(9)
            with pytest.raises(asyncio.CancelledError):
                await running
            return next(iter(listed))

        slurm_id = asyncio.run(scenario())
        wait_until(lambda: not batch_jobs(prefix), timeout=30, what="the cancelled batch job to leave the partition")
        assert slurm_state(slurm_id) == "CANCELLED"

    def test_an_earlier_attempts_batch_job_is_cancelled_before_the_next_is_submitted(
        self, make_driver, slurm_executor_name
    ):
        """A worker that died left its batch job running (here: submitted by hand under the name the
        driver gives job 11's batch jobs); the job's next attempt stops it before submitting."""
        orphan = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--partition={PARTITION}",
                f"--job-name=telemachus-{slurm_executor_name}-11",
                "--output=/dev/null",
                "--wrap=sleep 600",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

        result = asyncio.run(make_driver().execute(request("telemachus.add", 4, job_id=11)))

        assert result.output["value"] == 4
        assert slurm_state(orphan) == "CANCELLED"

    def test_probe_follows_the_partitions_state(self, make_driver):
        assert asyncio.run(make_driver().probe()).health == "ok"
        missing = asyncio.run(make_driver(partition="nosuchpartition").probe())
        assert missing.health == "down" and "no partition" in missing.detail
        subprocess.run(["scontrol", "update", f"PartitionName={PARTITION}", "State=DOWN"], check=True)
        try:
            down = asyncio.run(make_driver().probe())
        finally:
            subprocess.run(["scontrol", "update", f"PartitionName={PARTITION}", "State=UP"], check=True)
        assert down.health == "down" and "is down" in down.detail
        assert asyncio.run(make_driver().probe()).health == "ok"


# --- with real worker processes -------------------------------------------------------------------


def submit_task(user, callable: str, *args, **kwargs) -> Job:
    return job_submit(
        user=user,
        team="a",
        type="task",
        requirements={"model": "hpc"},
        input={"callable": callable, "args": list(args), "kwargs": kwargs},
    )


@pytest.fixture
def partition_executor(make_user, make_team, slurm_executor_name, tmp_path):
    """Given alice in team a and an hpc-partition executor with two slots."""
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    executor = Executor.objects.create(
        name=slurm_executor_name,
        kind="hpc-partition",
        capabilities={"models": ["hpc"]},
        max_concurrency=2,
        transport={"partition": PARTITION, "shared_dir": str(tmp_path / "shared")},
    )
    return alice, executor


class Sampler(threading.Thread):
    """Counts our batch jobs on the partition (squeue) every 50 ms until stopped."""

    def __init__(self, prefix: str) -> None:
        super().__init__(daemon=True)
        self.prefix, self.samples, self.stopping = prefix, [], threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.samples.append(len(batch_jobs(self.prefix)))
            time.sleep(0.05)


def statuses() -> dict[str, int]:
    return dict(Job.objects.values_list("status").annotate(n=Count("id")))


def slurm_ids(job: Job) -> list[str]:
    return [
        e.meta["slurm_job_id"]
        for e in JobEvent.objects.filter(job=job, event=JobEvent.Type.STEP).order_by("pk")
        if e.meta.get("action") == "batch_submitted"
    ]


@pytest.mark.slurm
@requires_slurm
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
class TestWithWorkerProcesses:
    def test_twenty_task_jobs_run_with_never_more_than_two_batch_jobs(self, processes, partition_executor):
        alice, executor = partition_executor
        jobs = [submit_task(alice, "telemachus.sleep", 0.5) for _ in range(20)]
        sampler = Sampler(f"telemachus-{executor.name}-")
        sampler.start()
        # Two workers, each willing to run eight jobs: only the executor's slots hold them to two.
        processes.worker("w1", concurrency=8)
        processes.worker("w2", concurrency=8)
        try:
            wait_until(lambda: statuses() == {"done": 20}, timeout=180, interval=0.5, what="20 task jobs done")
        finally:
            sampler.stopping.set()
            sampler.join()

        assert max(sampler.samples) == 2, sampler.samples  # at the cap, never above it
        done = list(Job.objects.filter(pk__in=[job.pk for job in jobs]))
        assert {job.executor_id for job in done} == {executor.pk}
        ran = [job.result["value"] for job in done]
        assert max_overlap([(v["started"], v["finished"]) for v in ran]) == 2
        ids = [slurm_ids(job) for job in done]
        assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 20  # one batch job each
        connection.close()

    def test_cancel_of_a_running_job_reaches_scancel(self, processes, partition_executor):
        alice, executor = partition_executor
        processes.worker("w", concurrency=8, TELEMACHUS_TASKS=f"test.mark_and_sleep={MODULE}.mark_and_sleep")
        marker = Path(processes.tmp_path) / "running"
        slow = submit_task(alice, "test.mark_and_sleep", str(marker), 600)
        wait_until(marker.exists, timeout=60, what="the task to start in its batch job")
        (slurm_id,) = slurm_ids(slow)
        assert batch_jobs(f"telemachus-{executor.name}-") == {slurm_id: "RUNNING"}

        job_cancel(job_id=slow.pk)

        wait_until(lambda: slurm_state(slurm_id) == "CANCELLED", timeout=30, what="the batch job to be cancelled")
        wait_until(lambda: not batch_jobs(f"telemachus-{executor.name}-"), timeout=30, what="it to leave the queue")
        assert Job.objects.get(pk=slow.pk).status == Job.Status.CANCELED
        after = submit_task(alice, "telemachus.add", 2, 3)
        wait_until(lambda: statuses() == {"canceled": 1, "done": 1}, timeout=60, interval=0.2, what="the next job")
        assert Job.objects.get(pk=after.pk).result["value"] == 5
        assert f"scancel {slurm_id}" in processes.procs[-1].log_path.read_text()
        connection.close()
