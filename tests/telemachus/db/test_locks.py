"""Every row lock of the project goes through telemachus/db/locks.py, where the one lock order is
written down: a lock taken anywhere else is a lock whose place in that order nobody checked."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ("telemachus", "quotas", "executors", "scheduler")
LOCKING = re.compile(r"select_for_update\(|FOR UPDATE|FOR SHARE|pg_advisory")


def test_no_row_lock_outside_the_locks_module():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for app in APPS
        for path in (ROOT / app).rglob("*.py")
        if path != ROOT / "telemachus" / "locks.py" and "migrations" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if LOCKING.search(line)
    ]
    assert found == []


def test_the_check_sees_a_lock():
    """The pattern finds the ways a lock is written (so the test above can fail)."""
    for line in ("Job.objects.select_for_update(skip_locked=True)", 'f"WHERE x FOR UPDATE OF j"'):
        assert LOCKING.search(line)
