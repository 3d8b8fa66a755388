"""Examples in docs/ run as written, against what `make run` sets up (the demo seed, a worker)
plus what the README tells a reader to add."""

import re
import subprocess
import sys

import pytest
from django.core.management import call_command

from executors.models import Executor
from scheduler.models import Job
from tests.processes import ROOT

pytestmark = pytest.mark.slow


def python_block(doc: str, heading: str) -> str:
    """The first ```python block after `heading` in docs/`doc`."""
    text = (ROOT / "docs" / doc).read_text()
    return re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S).group(1)


@pytest.mark.django_db(transaction=True)
def test_the_governed_slot_example_runs_as_written_in_manage_py_shell(processes):
    # Given the demo (team demo, its admin), a worker, and the README's simulated model server
    # connected as `gpu-1` offering `llama3`...
    call_command("telemachus_demo", stdout=open("/dev/null", "w"))
    base = processes.simllm(models="llama3", latency_ms=20)
    Executor.objects.create(
        name="gpu-1", kind="local-model", endpoint=f"{base}/v1", capabilities={"models": ["llama3"]}, max_concurrency=8
    )
    processes.worker("docs-worker")

    # When the example is pasted into `manage.py shell`...
    shell = subprocess.run(
        [sys.executable, "manage.py", "shell"],
        input=python_block("flows.md", "## A governed slot for your own agent loop"),
        cwd=ROOT,
        env=processes.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )

    # Then both calls (sync and async) got the model's reply through a governed slot on gpu-1.
    assert shell.returncode == 0 and "Traceback" not in shell.stderr, shell.stdout + shell.stderr
    assert shell.stdout.count("[simulated by simllm]") == 2, shell.stdout
    governed = Job.objects.filter(type="governed")
    assert [(j.status, j.team.slug, j.executor.name) for j in governed] == [("done", "demo", "gpu-1")] * 2
    assert all(j.tokens_used > 0 for j in governed)
