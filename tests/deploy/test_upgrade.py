"""An upgrade from the previous release, in the order docs/deploy.md ("Upgrades") gives, while jobs
flow: the previous release (commit PREVIOUS, checked out into a temporary `git worktree`, run with
this venv and PYTHONPATH on its tree) serves a database migrated to its own schema, an API server
and a worker of it taking and running jobs; this release's migrations are applied while they work
(whatever migrations this checkout has beyond PREVIOUS's); the old worker keeps finishing jobs,
submitted after the migrations too; then this release's API server and worker start, the old
worker drains on SIGTERM, and every job submitted, through either release, finishes once.

It needs the repository's history (CI runs on a full clone of main) and PostgreSQL."""

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.databases import database_url, scratch_database, server_connect
from tests.deploy.tools import missing, tool
from tests.processes import ROOT, Processes, free_port, responds, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

# The previous release: the last commit of main before this release's work began.
PREVIOUS = "66fe446"
LEASE_SECONDS = "5"


@pytest.fixture
def previous_tree():
    """The previous release's tree, in a temporary worktree of this repository (removed after)."""
    git = tool("git", package="git")
    if subprocess.run([git, "cat-file", "-e", f"{PREVIOUS}^{{commit}}"], cwd=ROOT, capture_output=True).returncode:
        missing(f"needs commit {PREVIOUS} (the previous release) in the repository's history: a full clone")
    tree = Path(tempfile.mkdtemp(prefix="telemachus-previous-")) / "tree"
    subprocess.run([git, "worktree", "add", "--detach", str(tree), PREVIOUS], cwd=ROOT, check=True, capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run([git, "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        subprocess.run([git, "worktree", "prune"], cwd=ROOT, capture_output=True)


def applied_migrations(dbname: str) -> set[tuple[str, str]]:
    with server_connect(dbname) as db:
        return set(db.execute("SELECT app, name FROM django_migrations").fetchall())


def test_the_previous_releases_worker_keeps_working_while_this_releases_migrations_run(
    previous_tree, tmp_path, django_db_blocker
):
    processes = Processes(tmp_path)
    flowing = threading.Event()
    refused: list[str] = []
    with django_db_blocker.unblock(), scratch_database("upgrade") as dbname:
        env = {
            "DJANGO_SETTINGS_MODULE": "telemachus.settings",
            "DATABASE_URL": database_url(dbname),
            "REDIS_URL": "",
            "TELEMACHUS_VAR_DIR": str(tmp_path / "var"),
            "TELEMACHUS_LEASE_SECONDS": LEASE_SECONDS,
        }
        old_env = {**env, "PYTHONPATH": str(previous_tree)}

        def manage(tree: Path, extra: dict[str, str], *args: str) -> str:
            done = subprocess.run(
                [sys.executable, "manage.py", *args],
                cwd=tree,
                env=processes.env(**extra),
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0, f"{tree}: manage.py {' '.join(args)}\n{done.stderr[-3000:]}"
            return done.stdout

        def spawn(name: str, tree: Path, extra: dict[str, str], *argv: str) -> subprocess.Popen:
            log = open(tmp_path / f"{name}.log", "w")
            proc = subprocess.Popen(
                [sys.executable, *argv], cwd=tree, env=processes.env(**extra), stdout=log, stderr=subprocess.STDOUT
            )
            proc.log_path = tmp_path / f"{name}.log"  # type: ignore[attr-defined]
            processes.procs.append(proc)
            return proc

        def api(name: str, tree: Path, extra: dict[str, str]) -> str:
            port = free_port()
            spawn(name, tree, extra, "-m", "telemachus.serve", "127.0.0.1", str(port))
            base = f"http://127.0.0.1:{port}"
            wait_until(lambda: responds(f"{base}/healthz"), timeout=60, what=f"{name} to listen")
            return base

        try:
            # Given the previous release running on its own schema: an API server, a worker, jobs
            manage(previous_tree, old_env, "migrate", "--noinput")
            before = applied_migrations(dbname)
            manage(previous_tree, old_env, "telemachus_demo")
            token = manage(previous_tree, old_env, "drf_create_token", "admin").split()[2]
            old_api = api("old-api", previous_tree, old_env)
            old_worker = spawn(
                "old-worker", previous_tree, old_env, "manage.py", "scheduler_worker", "--name", "old", "--grace", "10"
            )
            submitted: list[int] = []
            target = {"base": old_api}
            flowing.set()

            def submit() -> None:
                body = {
                    "type": "chat",
                    "team": "demo",
                    "requirements": {"model": "sim", "est_tokens": 20},
                    "input": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
                }
                with httpx.Client(headers={"Authorization": f"Token {token}"}, timeout=30) as client:
                    while flowing.is_set():
                        response = client.post(f"{target['base']}/api/jobs/", json=body)
                        if response.status_code != 201:
                            refused.append(f"{target['base']}: {response.status_code} {response.text[:300]}")
                            return
                        submitted.append(response.json()["id"])
                        time.sleep(0.05)

            submitter = threading.Thread(target=submit, daemon=True)
            submitter.start()

            def finished_by(worker: str) -> int:
                with server_connect(dbname) as db:
                    return db.execute(
                        "SELECT count(*) FROM scheduler_job WHERE status = 'done' AND worker = %s", [worker]
                    ).fetchone()[0]

            wait_until(lambda: finished_by("old") >= 3, timeout=60, what="the old worker to finish jobs")

            # When this release's migrations are applied while it works
            manage(ROOT, env, "migrate", "--noinput")
            new_migrations = applied_migrations(dbname) - before
            print(f"this release's migrations, applied under the previous release's worker: {sorted(new_migrations)}")
            migrated_at = len(submitted)

            # Then the old worker keeps finishing jobs, those submitted after the migrations too
            def old_worker_runs_new_jobs() -> bool:
                with server_connect(dbname) as db:
                    return (
                        db.execute(
                            "SELECT count(*) FROM scheduler_job WHERE status = 'done' AND worker = 'old' AND id > %s",
                            [submitted[migrated_at - 1]],
                        ).fetchone()[0]
                        >= 3
                    )

            wait_until(old_worker_runs_new_jobs, timeout=60, what="the old worker to finish jobs after migrate")
            assert old_worker.poll() is None

            # And when this release's API server and worker start, and the old ones stop (in that order)
            target["base"] = api("new-api", ROOT, env)
            spawn("new-worker", ROOT, env, "manage.py", "scheduler_worker", "--name", "new", "--grace", "10")
            wait_until(lambda: finished_by("new") >= 3, timeout=60, what="the new worker to finish jobs")
            old_worker.terminate()
            assert old_worker.wait(timeout=30) == 0
            time.sleep(0.5)  # jobs keep coming through the new API
            flowing.clear()
            submitter.join(timeout=30)
            assert not refused, refused

            # Then every job submitted through either release finishes, once
            def all_done() -> bool:
                with server_connect(dbname) as db:
                    statuses = dict(db.execute("SELECT id, status FROM scheduler_job").fetchall())
                return set(statuses) == set(submitted) and set(statuses.values()) == {"done"}

            wait_until(all_done, timeout=60, interval=0.2, what="every job to finish")
            with server_connect(dbname) as db:
                finished = dict(
                    db.execute(
                        "SELECT job_id, count(*) FROM scheduler_jobevent WHERE event = 'finished' GROUP BY job_id"
                    ).fetchall()
                )
            assert finished == dict.fromkeys(submitted, 1)
            for proc in processes.procs:
                log = proc.log_path.read_text()  # type: ignore[attr-defined]
                assert "Traceback" not in log, log[-3000:]
        finally:
            flowing.clear()
            processes.stop_all()
