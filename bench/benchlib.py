"""What the benchmark scripts share: percentiles, the scratch PostgreSQL database each one
creates, runs in and drops (on the server that BENCH_PG_URL names, 127.0.0.1 by default), the
peers' own environment, and the CPU time of the processes under test."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

PG_ADMIN_URL = os.environ.get("BENCH_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
BENCH = Path(__file__).resolve().parent
PEERS_VENV = BENCH / ".venv-peers"
PEERS_REQUIREMENTS = BENCH / "requirements.txt"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pg_url(database: str) -> str:
    """DATABASE_URL of a database on the same server as PG_ADMIN_URL."""
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{database}"


def pg_database(database: str, action: str) -> None:
    """Drop the database if it exists (with its connections), then create it when `action` is
    "create"."""
    import psycopg

    with psycopg.connect(PG_ADMIN_URL.replace("postgres://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if action == "create":
            conn.execute(f'CREATE DATABASE "{database}"')


def pg_backends(database: str) -> list[int]:
    """Process ids of the PostgreSQL server processes serving `database`'s connections, so their
    CPU can be counted with the service's own (the server runs on this machine)."""
    import psycopg

    with psycopg.connect(PG_ADMIN_URL.replace("postgres://", "postgresql://"), autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (database,)).fetchall()
    return [pid for (pid,) in rows]


def peers_python(given: str | None = None) -> str:
    """The python of bench/.venv-peers, made on first use and brought up to date whenever
    bench/requirements.txt changes (a stamp of its hash sits in the environment), so a fresh
    machine and an old environment both run the peers the file names. `given` (--peers-python)
    points at another environment, used as it is."""
    if given:
        return given
    python = PEERS_VENV / "bin" / "python"
    stamp = PEERS_VENV / ".requirements-sha256"
    wanted = hashlib.sha256(PEERS_REQUIREMENTS.read_bytes()).hexdigest()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    if not stamp.exists() or stamp.read_text().strip() != wanted:
        print(f"installing the peers into {PEERS_VENV} (a few minutes the first time)", file=sys.stderr)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(PEERS_REQUIREMENTS)], check=True)
        stamp.write_text(wanted + "\n")
    return str(python)


def process_tree(pids: list[int]) -> list[int]:
    """`pids` and every process descended from them (a server's worker processes), read from
    /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(_stat_fields(int(entry))[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU time of each live process in `pids`, from /proc/PID/stat; a pid that has
    gone is left out."""
    times = {}
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        times[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return times


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two `cpu_seconds` readings; a process born in between counts
    from zero (one that ended in between is lost, which is why servers are read, not clients)."""
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def _stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): state, ppid,
    ... so utime and stime are [11] and [12]."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()
