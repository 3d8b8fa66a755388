"""Runs one task job inside a Slurm batch job: the `hpc-partition` driver's batch script is
`exec <python> -m executors.slurm_runner <spec.json>` (executors/drivers/slurm.py).

The spec, written by the driver in the shared directory, says what to run:

    {"job_id": 42, "executor": "slurm-debug", "settings": "telemachus.settings",
     "input": {"callable": "telemachus.sha256", "args": ["abc"], "kwargs": {}},
     "result": "/shared/.../result.json"}

The runner sets DJANGO_SETTINGS_MODULE (a node's environment may not have it, with
`--export=NONE`), sets Django up, resolves the callable exactly as a cpu-node pool process does
(`executors.drivers.cpu.task_call`: only registered or declared tasks, never an arbitrary path)
and writes what happened to `result`, atomically (a temporary file renamed into place), as
`executors.tasks.TaskOutcome` in JSON, plus `refused` when this node would not run the call (its
registry differs from the worker's). It exits 0 whenever it wrote a result, so a non-zero exit
means the runner itself could not run (no Python, no project on the node).
"""

import dataclasses
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any


def spec_run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the spec's task call here; what the result file holds."""
    from executors.contract import DispatchError, DispatchRequest
    from executors.drivers.cpu import task_call
    from executors.tasks import task_run

    request = DispatchRequest(job_id=int(spec["job_id"]), type="task", model=spec.get("model", ""), input=spec["input"])
    try:
        _, fn, args, kwargs = task_call(request, kind="hpc-partition", executor_name=spec.get("executor", "?"))
    except DispatchError as exc:
        return {"ok": False, "refused": str(exc), "node": socket.gethostname()}
    outcome = task_run(fn, args, kwargs)
    return {**dataclasses.asdict(outcome), "node": socket.gethostname()}


def result_write(path: Path, result: dict[str, Any]) -> None:
    """Write the result so the driver never reads half of it: the driver takes the file's
    existence as "the task ended"."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result))
    os.replace(partial, path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m executors.slurm_runner SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    os.environ["DJANGO_SETTINGS_MODULE"] = spec["settings"]
    import django

    django.setup()
    result_write(Path(spec["result"]), spec_run(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
