"""The system tools the deployment tests drive (nginx, openssl, systemd-analyze, PostgreSQL's
server binaries, redis-server, git): found, or the test is skipped with the reason and the package
to install. CI installs every one of them (.ci/run) and sets TELEMACHUS_REQUIRE_DEPLOY_TOOLS=1, and
then a missing tool fails the test instead: a skip there would hide a deployment check."""

import glob
import os
import shutil
from pathlib import Path

import pytest

REQUIRED = os.environ.get("TELEMACHUS_REQUIRE_DEPLOY_TOOLS") == "1"


def missing(reason: str) -> None:
    """Skip (a developer's machine) or fail (CI) for a tool that is not there."""
    if REQUIRED:
        pytest.fail(f"{reason} (TELEMACHUS_REQUIRE_DEPLOY_TOOLS=1: CI installs it, so it must be there)")
    pytest.skip(reason)


def tool(name: str, *, package: str) -> str:
    """The path of command `name`; `package` is Debian's package that brings it."""
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name) if p.exists()), None
    )
    if found is None:
        missing(f"needs {name} (Debian: apt-get install {package})")
    return found  # type: ignore[return-value]


def postgres_bin(name: str) -> str:
    """A PostgreSQL server binary (initdb, pg_ctl): Debian keeps them off PATH, in
    /usr/lib/postgresql/<major>/bin; the newest major installed."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return found[-1]
    return tool(name, package="postgresql")
