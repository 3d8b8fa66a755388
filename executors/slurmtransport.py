"""How an `hpc-partition` executor reaches its Slurm partition: the row's `transport`.

    {"partition": "gpu",                                 required: the Slurm partition
     "sbatch_options": ["--time=30", "--gres=gpu:1"],    optional: extra sbatch long options
     "shared_dir": "/shared/telemachus",                 optional: spec and result files
     "python": "/opt/telemachus/.venv/bin/python"}       optional: the interpreter on the nodes

The API and the admin refuse anything else with a 400 naming the field (`fields.transport.<name>`);
the driver reads a stored value (written by SQL) through `partition_transport`, which raises
ValueError for the same problems so such a row fails its jobs with the reason instead of running
a malformed sbatch. Kept out of the driver module so models.py can check shapes without importing
the contract (which imports models).

No secrets here: sbatch authenticates through munge on the worker's host."""

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

PARTITION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The options the driver sets itself (or that would change what a submission means: an array is
# many jobs, --wait blocks the CLI, --test-only and --hold never run). Matched on the long name.
RESERVED_OPTIONS = frozenset(
    {
        "partition",
        "output",
        "error",
        "input",
        "job-name",
        "chdir",
        "parsable",
        "wrap",
        "array",
        "wait",
        "test-only",
        "hold",
        "help",
        "usage",
        "version",
    }
)
KNOWN_KEYS = frozenset({"partition", "sbatch_options", "shared_dir", "python"})


@dataclass(frozen=True)
class PartitionTransport:
    partition: str
    sbatch_options: tuple[str, ...] = ()
    shared_dir: str | None = None
    python: str | None = None


def _absolute(value: Any) -> bool:
    return isinstance(value, str) and PurePosixPath(value).is_absolute() and "\x00" not in value


def transport_problems(transport: dict[str, Any]) -> dict[str, str]:
    """Each field of an hpc-partition executor's `transport` that is missing or malformed, with
    what is wrong."""
    problems = {}
    partition = transport.get("partition")
    if not (isinstance(partition, str) and PARTITION_NAME.fullmatch(partition)):
        problems["partition"] = "must name the Slurm partition (letters, digits, '_', '.', '-')."
    options = transport.get("sbatch_options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        problems["sbatch_options"] = 'must be a list of sbatch long options, like ["--time=30"].'
    else:
        for option in options:
            name = option[2:].partition("=")[0]
            if not option.startswith("--") or not name or "\n" in option or "\x00" in option:
                problems["sbatch_options"] = f"{option!r:.60} is not a long option (--name or --name=value)."
                break
            if name in RESERVED_OPTIONS:
                problems["sbatch_options"] = f"--{name} is set by the driver and cannot be given here."
                break
    for key in ("shared_dir", "python"):
        if key in transport and not _absolute(transport[key]):
            problems[key] = "must be an absolute path."
    unknown = sorted(set(transport) - KNOWN_KEYS)
    if unknown:
        problems[unknown[0]] = f"is not a field of an hpc-partition transport ({', '.join(sorted(KNOWN_KEYS))})."
    return problems


def partition_transport(transport: dict[str, Any]) -> PartitionTransport:
    """The transport as the driver uses it; ValueError naming each problem when it is malformed."""
    problems = transport_problems(transport)
    if problems:
        raise ValueError("; ".join(f"transport.{name} {problem}" for name, problem in problems.items()))
    return PartitionTransport(
        partition=transport["partition"],
        sbatch_options=tuple(transport.get("sbatch_options", ())),
        shared_dir=transport.get("shared_dir"),
        python=transport.get("python"),
    )
