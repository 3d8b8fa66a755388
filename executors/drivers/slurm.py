"""The `hpc-partition` executor: runs task jobs as Slurm batch jobs on one partition.

Why the CLI (sbatch, scontrol, scancel, sinfo) and not slurmrestd: the commands need only what
every login node already has (the Slurm client, munge, slurm.conf) and authenticate as the
worker's user through munge, so no secret is stored or rotated; slurmrestd is an extra daemon
that many sites do not run, authenticates with JWTs that expire (a key in the controller, tokens
to renew on every worker) and versions its OpenAPI paths with each Slurm release. The price is a
process per command (a few milliseconds), which is small beside a batch job's own start-up. A
worker that runs this driver must therefore have the Slurm client commands and see the cluster.

A job of type `task` carries the same input as on a cpu-node (executors/drivers/cpu.py):
`{"callable": "<task name>", "args": [...], "kwargs": {...}}`, checked in the worker before
anything is submitted (an unknown task or bad arguments never reach Slurm) and resolved again on
the node by the same code (executors/slurm_runner.py). Its result has the cpu-node's shape:
`{"value": ..., "task": <name>, "elapsed_s": <seconds in the call>}`; a task that raises fails
its job with `{"exception_class", "traceback"}` as the result.

One dispatch:
  1. write `spec.json` and `job.sh` in a directory of its own under the shared directory
     (transport.shared_dir, default <VAR_DIR>/slurm: the nodes must see it at the same path, as
     they must see the project, whose Python runs there);
  2. `scancel --name` any batch job left by an earlier attempt of the same job (its worker died,
     so nobody cancelled it), then `sbatch --parsable` onto the partition with the job's name
     `telemachus-<executor>-<job id>`; the Slurm job id goes to the job's events as a `step`
     event (`action: batch_submitted`, `slurm_job_id`) through `report_step`;
  3. wait without busy-looping: the result file is looked for every 0.2 s, backing off to 0.5 s
     (a local stat); Slurm is asked (`scontrol show job -o`) every 0.5 s backing off to 5 s, and
     every tick once the result exists, until the batch job has ended (not COMPLETING: until then
     it holds its CPUs, and returning earlier would let the next dispatch exceed the partition's
     share);
  4. read `result.json`, remove the directory.

Capacity: no more batch jobs are submitted than the executor has slots: the claim places at most
`max_concurrency` jobs on the executor across every worker, and a dispatch holds its slot until
its batch job has left the partition's queue, so `max_concurrency` is how many batch jobs of this
executor the partition holds at once (pending or running).

Cancel: `cancel(job_id)` cancels the dispatch and `scancel`s its batch job; a cancel that arrives
while sbatch is still running waits for its job id and cancels that. A lost lease and a forced
worker shutdown go through the same path.

Health (`probe`): `sinfo -h -p PART -o %a/%T`. The partition not up (down, drain, inactive) or
missing, or none of its nodes able to take work (down, drained, draining, failing, not
responding): down; some of them unable: degraded; else ok.
"""

import asyncio
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from executors.contract import DispatchError, DispatchRequest, DispatchResult, ExecutorDriver, Probe
from executors.drivers.cpu import task_call
from executors.models import Executor
from executors.slurmtransport import PartitionTransport, partition_transport

log = logging.getLogger("telemachus.executors")

# Looking for the result file (a local stat): first after POLL_MIN, backing off to POLL_MAX.
POLL_MIN, POLL_MAX, POLL_GROWTH = 0.2, 0.5, 1.5
# Asking Slurm (one RPC to the controller per batch job): first after QUERY_MIN, doubling to QUERY_MAX.
QUERY_MIN, QUERY_MAX = 0.5, 5.0
# How long one command may take (sbatch retries an unreachable controller for a while itself).
COMMAND_TIMEOUT = 60.0
# How long the controller may stay unreachable while a batch job runs before the dispatch gives up.
UNREACHABLE_LIMIT = 120.0
OUTPUT_TAIL = 2000

# Slurm job states after which the job holds nothing on the partition (squeue's long names).
ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
GONE = "GONE"  # purged from the controller (older than MinJobAge): ended, state unknown
# Node states (sinfo %T) in which a node takes no new work.
UNUSABLE_NODE = frozenset({"down", "drained", "draining", "drain", "fail", "failing", "maint", "future", "inval"})
# Messages of commands that failed because the controller could not be reached (worth retrying).
UNREACHABLE = re.compile(
    r"unable to contact slurm controller|socket timed out|connection refused|temporarily unavailable|"
    r"communication|slurm_load_jobs error: zero bytes|timed out",
    re.IGNORECASE,
)
INVALID_JOB = re.compile(r"invalid job id", re.IGNORECASE)


@dataclass(frozen=True)
class Command:
    returncode: int
    stdout: str
    stderr: str

    @property
    def unreachable(self) -> bool:
        return self.returncode != 0 and bool(UNREACHABLE.search(self.stderr))


class CommandTimeout(Exception):
    pass


class SlurmPartitionDriver(ExecutorDriver):
    kind = "hpc-partition"
    chat = False
    tasks = True

    def __init__(self, executor: Executor) -> None:
        super().__init__(executor)
        self._batch: dict[int, str] = {}  # Telemachus job id -> Slurm job id, while dispatched
        self._cancelled: set[str] = set()  # Slurm job ids this driver scancelled

    # --- configuration --------------------------------------------------------------------------

    def _transport(self) -> PartitionTransport:
        try:
            return partition_transport(self.executor.transport)
        except ValueError as exc:
            raise DispatchError(f"{self.executor.name}: {exc}", retryable=False, executor_fault=True) from exc

    def _job_name(self, job_id: int) -> str:
        return f"telemachus-{self.executor.name}-{job_id}"

    def _shared_dir(self, transport: PartitionTransport) -> Path:
        return Path(transport.shared_dir) if transport.shared_dir else Path(settings.VAR_DIR) / "slurm"

    # --- dispatch -------------------------------------------------------------------------------

    async def dispatch(self, request: DispatchRequest) -> DispatchResult:
        name, _, _, _ = task_call(request, kind=self.kind, executor_name=self.executor.name)
        transport = self._transport()
        workdir = await asyncio.to_thread(self._prepare, request, transport)
        slurm_id = None
        try:
            submission = asyncio.ensure_future(self._submit(request, transport, workdir))
            try:
                slurm_id = await asyncio.shield(submission)
            except asyncio.CancelledError:
                # Cancelled while sbatch ran: the batch job may exist already; find it and stop it.
                if not submission.cancelled():
                    try:
                        await self._scancel(await submission)
                    except DispatchError:
                        pass
                raise
            self._batch[request.job_id] = slurm_id
            await self.report_step(
                request.job_id, action="batch_submitted", slurm_job_id=slurm_id, partition=transport.partition
            )
            try:
                state, exit_code = await self._wait(slurm_id, workdir / "result.json")
            except asyncio.CancelledError:
                await asyncio.shield(self._scancel(slurm_id))
                raise
            return await asyncio.to_thread(self._outcome, name, slurm_id, state, exit_code, workdir)
        finally:
            self._batch.pop(request.job_id, None)
            self._cancelled.discard(slurm_id or "")
            await asyncio.to_thread(shutil.rmtree, workdir, True)

    def _prepare(self, request: DispatchRequest, transport: PartitionTransport) -> Path:
        """The dispatch's directory, with the runner's spec and the batch script."""
        workdir = self._shared_dir(transport) / self.executor.name / f"{request.job_id}-{secrets.token_hex(4)}"
        workdir.mkdir(parents=True)
        spec = {
            "job_id": request.job_id,
            "executor": self.executor.name,
            "model": request.model,
            "settings": getattr(settings, "SETTINGS_MODULE", None) or os.environ["DJANGO_SETTINGS_MODULE"],
            "input": request.input,
            "result": str(workdir / "result.json"),
        }
        (workdir / "spec.json").write_text(json.dumps(spec))
        python = transport.python or sys.executable
        (workdir / "job.sh").write_text(
            "#!/bin/sh\n"
            f"# Telemachus job {request.job_id} on executor {self.executor.name}\n"
            f"exec {shlex.quote(python)} -m executors.slurm_runner {shlex.quote(str(workdir / 'spec.json'))}\n"
        )
        return workdir

    async def _submit(self, request: DispatchRequest, transport: PartitionTransport, workdir: Path) -> str:
        job_name = self._job_name(request.job_id)
        # A batch job of an earlier attempt whose worker died is still ours to stop: the slot it
        # used is this attempt's now.
        stale = await self._command("scancel", f"--name={job_name}", f"--partition={transport.partition}")
        if stale.returncode == 0 and stale.stderr.strip():
            log.info("job %d: scancel of earlier attempts said %s", request.job_id, stale.stderr.strip())
        submitted = await self._command(
            "sbatch",
            "--parsable",
            f"--partition={transport.partition}",
            f"--job-name={job_name}",
            f"--output={workdir / 'slurm.out'}",
            f"--chdir={settings.BASE_DIR}",
            *transport.sbatch_options,
            str(workdir / "job.sh"),
        )
        if submitted.returncode != 0:
            message = submitted.stderr.strip() or f"sbatch exited {submitted.returncode}"
            unreachable = submitted.unreachable
            raise DispatchError(
                f"{self.executor.name}: sbatch refused the job: {message}",
                retryable=unreachable,
                executor_fault=True,
            )
        slurm_id = submitted.stdout.strip().split(";")[0]
        if not slurm_id.isdigit():
            raise DispatchError(f"{self.executor.name}: sbatch said {submitted.stdout!r:.200}", retryable=False)
        log.info("job %d: batch job %s submitted to partition %s", request.job_id, slurm_id, transport.partition)
        return slurm_id

    async def _wait(self, slurm_id: str, result: Path) -> tuple[str, str]:
        """Until the batch job has ended: its state and exit code."""
        delay, query_every = POLL_MIN, QUERY_MIN
        next_query = time.monotonic() + QUERY_MIN
        reachable_at = time.monotonic()
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * POLL_GROWTH, POLL_MAX)
            finished = result.exists()
            if not finished and time.monotonic() < next_query:
                continue
            state, exit_code = await self._job_state(slurm_id)
            if state in ENDED or state == GONE:
                return state, exit_code
            if state == "":
                if time.monotonic() - reachable_at > UNREACHABLE_LIMIT:
                    if finished:
                        return GONE, ""  # the result is there; the controller may catch up later
                    await self._scancel(slurm_id, quiet=True)
                    raise DispatchError(
                        f"{self.executor.name}: the Slurm controller was unreachable for {UNREACHABLE_LIMIT:.0f}s "
                        f"while batch job {slurm_id} ran",
                        retryable=True,
                        executor_fault=True,
                    )
            else:
                reachable_at = time.monotonic()
            query_every = min(query_every * 2, QUERY_MAX)
            next_query = time.monotonic() + query_every

    async def _job_state(self, slurm_id: str) -> tuple[str, str]:
        """The batch job's state and exit code from the controller; GONE when it no longer knows
        the job, "" when it could not be asked."""
        try:
            shown = await self._command("scontrol", "show", "job", "-o", slurm_id)
        except CommandTimeout:
            return "", ""
        if shown.returncode != 0:
            if INVALID_JOB.search(shown.stderr):
                return GONE, ""
            log.warning("%s: scontrol show job %s failed: %s", self.executor.name, slurm_id, shown.stderr.strip())
            return "", ""
        fields = dict(re.findall(r"(\w+)=(\S*)", shown.stdout))
        return fields.get("JobState", ""), fields.get("ExitCode", "")

    def _outcome(self, name: str, slurm_id: str, state: str, exit_code: str, workdir: Path) -> DispatchResult:
        """The job's result from the runner's result file, or the reason there is none."""
        try:
            result = json.loads((workdir / "result.json").read_text())
        except FileNotFoundError:
            result = None
        where = f"{self.executor.name}: batch job {slurm_id}"
        if result is not None:
            if result.get("refused"):
                raise DispatchError(f"{where}: the node refused the task: {result['refused']}", retryable=False)
            if not result.get("ok"):
                detail = None
                if result.get("traceback"):
                    # A task that raises is the task's failure, not the worker's: one line, and its
                    # traceback goes to the job's result (which retention may remove), not the log.
                    log.info("task %r raised %s in batch job %s", name, result["exception_class"], slurm_id)
                    detail = {"exception_class": result["exception_class"], "traceback": result["traceback"]}
                raise DispatchError(f"task {name!r} {result.get('error')}", retryable=False, detail=detail)
            value = json.loads(result["value_json"])
            return DispatchResult(output={"value": value, "task": name, "elapsed_s": round(result["elapsed_s"], 6)})
        output = _tail(workdir / "slurm.out")
        said = f": {output}" if output else ""
        if state == "TIMEOUT":
            raise DispatchError(f"{where} hit its time limit{said}", retryable=False, timed_out=True)
        if state == "OUT_OF_MEMORY":
            raise DispatchError(f"{where} ran out of memory{said}", retryable=False)
        if state in ("NODE_FAIL", "BOOT_FAIL"):
            raise DispatchError(f"{where} lost its node ({state}){said}", retryable=True, executor_fault=True)
        if state in ("CANCELLED", "PREEMPTED", "DEADLINE"):
            raise DispatchError(f"{where} ended {state} outside Telemachus{said}", retryable=True, executor_fault=False)
        raise DispatchError(
            f"{where} ended {state or 'unknown'} (exit {exit_code or '?'}) without a result{said}",
            retryable=False,
            executor_fault=True,
        )

    # --- cancel ---------------------------------------------------------------------------------

    async def cancel(self, job_id: int) -> bool:
        """Abort the dispatch and scancel its batch job."""
        aborted = await super().cancel(job_id)
        slurm_id = self._batch.get(job_id)
        if slurm_id is not None:
            await self._scancel(slurm_id)
        return aborted

    async def _scancel(self, slurm_id: str, *, quiet: bool = False) -> None:
        if slurm_id in self._cancelled:
            return
        self._cancelled.add(slurm_id)
        try:
            done = await self._command("scancel", slurm_id)
        except (CommandTimeout, DispatchError) as exc:
            log.warning("%s: scancel %s failed: %s", self.executor.name, slurm_id, exc)
            return
        if not quiet:
            log.info("%s: scancel %s: %s", self.executor.name, slurm_id, done.stderr.strip() or "ok")

    # --- health ---------------------------------------------------------------------------------

    async def probe(self) -> Probe:
        try:
            partition = partition_transport(self.executor.transport).partition
        except ValueError as exc:
            return Probe(health=Executor.Health.DOWN, detail=str(exc))
        started = time.perf_counter()
        try:
            shown = await self._command("sinfo", "-h", "-p", partition, "-o", "%a/%T")
        except (CommandTimeout, DispatchError) as exc:
            return Probe(health=Executor.Health.DOWN, detail=str(exc))
        latency = (time.perf_counter() - started) * 1000
        if shown.returncode != 0:
            return Probe(health=Executor.Health.DOWN, latency_ms=latency, detail=shown.stderr.strip()[:300])
        return partition_health(partition, shown.stdout, latency_ms=latency)

    # --- commands -------------------------------------------------------------------------------

    async def _command(self, *argv: str) -> Command:
        """Run one Slurm command without blocking the event loop; killed when it overruns
        COMMAND_TIMEOUT (CommandTimeout) or when the awaiting task is cancelled."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except FileNotFoundError as exc:
            # Another worker may have the Slurm client: worth another attempt, not this executor's fault.
            raise DispatchError(
                f"{self.executor.name}: {argv[0]} is not installed on this worker's host",
                retryable=True,
                executor_fault=False,
            ) from exc
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), COMMAND_TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise CommandTimeout(f"{argv[0]} did not answer within {COMMAND_TIMEOUT:.0f}s") from None
        except asyncio.CancelledError:
            if proc.returncode is None:
                proc.kill()
            raise
        assert proc.returncode is not None
        return Command(proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace"))


def partition_health(partition: str, sinfo: str, *, latency_ms: float | None = None) -> Probe:
    """Health from `sinfo -h -p PART -o %a/%T` (one line per distinct availability/node state)."""
    lines = [line.strip() for line in sinfo.splitlines() if line.strip()]
    if not lines:
        return Probe(health=Executor.Health.DOWN, latency_ms=latency_ms, detail=f"no partition {partition!r}")
    availability = {line.partition("/")[0] for line in lines}
    if availability != {"up"}:
        return Probe(
            health=Executor.Health.DOWN,
            latency_ms=latency_ms,
            detail=f"partition {partition} is {', '.join(sorted(availability))}",
        )
    states = [line.partition("/")[2] for line in lines]
    # '*' marks a node that does not respond; other suffixes (~ powered off, # powering up, ...)
    # are nodes that will take work.
    unusable = [s for s in states if s.endswith("*") or s.rstrip("~#!%$@^-+*") in UNUSABLE_NODE]
    if len(unusable) == len(states):
        return Probe(
            health=Executor.Health.DOWN,
            latency_ms=latency_ms,
            detail=f"no node of partition {partition} takes work ({', '.join(states)})",
        )
    if unusable:
        return Probe(
            health=Executor.Health.DEGRADED,
            latency_ms=latency_ms,
            detail=f"partition {partition} has nodes that take no work ({', '.join(unusable)})",
        )
    return Probe(health=Executor.Health.OK, latency_ms=latency_ms)


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text[-OUTPUT_TAIL:].strip()
