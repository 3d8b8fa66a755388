"""deploy/systemd/: the units a host installs, checked as systemd reads them and run as it runs them.

* `systemd-analyze verify` accepts every unit (an API instance, a worker instance, the runtime
  directory's oneshot, the target) with not one warning: systemd only warns, and starts the unit
  anyway, for an unknown key or a value it cannot parse, so a warning fails here; and the same
  check fails on units broken in each of those ways (it is not a check that cannot fail).
* `systemd-analyze security --offline` rates the API and worker units' hardening "OK" or better.
* The units agree with the app and each other: the worker's stop timeout outlasts its grace, the
  processes write their metrics where the hardening lets them, the API instances are what nginx
  proxies to.
* Their command lines, expanded as systemd expands them (specifiers, the Environment= defaults,
  an environment file), start a serving API and a worker that drains on SIGTERM, gives back what
  is left after TELEMACHUS_SHUTDOWN_GRACE, and exits within TimeoutStopSec.

The units name /opt/telemachus/current (the release a host runs); the checks stage them with that
path pointing at this checkout (its venv's python, its manage.py), as a host's link would."""

import configparser
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scheduler.models import Job, JobEvent
from scheduler.services.submit import job_submit
from tests.deploy.tools import tool
from tests.processes import ROOT, database_url_for_tests, free_port, responds, wait_until

UNITS = ROOT / "deploy/systemd"
RELEASE = "/opt/telemachus/current"
INSTANCES = [
    "telemachus-api@8001.service",
    "telemachus-worker@1.service",
    "telemachus-runtime.service",
    "telemachus.target",
]


def staged(directory: Path, *, breaking: tuple[str, str] | None = None) -> Path:
    """The units, with the release path pointing at this checkout; `breaking` replaces one text
    of the API unit by another (a unit broken on purpose). Returns the units' directory."""
    release = directory / "current"
    (release / ".venv/bin").mkdir(parents=True)
    (release / ".venv/bin/python").symlink_to(sys.executable)
    (release / "manage.py").symlink_to(ROOT / "manage.py")
    units = directory / "units"
    units.mkdir()
    for unit in UNITS.iterdir():
        text = unit.read_text().replace(RELEASE, str(release))
        if breaking is not None and unit.name == "telemachus-api@.service":
            assert breaking[0] in text
            text = text.replace(breaking[0], breaking[1], 1)
        (units / unit.name).write_text(text)
    return units


def analyze(units: Path, *args: str) -> subprocess.CompletedProcess:
    """systemd-analyze with the staged units first on its search path (the trailing colon keeps
    the system's, for the targets they name)."""
    command = tool("systemd-analyze", package="systemd")
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}
    return subprocess.run([command, *args], cwd=units, env=env, capture_output=True, text=True)


def verified(units: Path) -> str | None:
    """None when `systemd-analyze verify` accepts every unit without a word; else what it said."""
    done = analyze(units, "verify", *INSTANCES)
    said = (done.stdout + done.stderr).strip()
    if done.returncode == 0 and not said:
        return None
    return f"exit {done.returncode}: {said}"


def unit(name: str) -> configparser.ConfigParser:
    """A unit file's settings; a key given several times keeps its last value (enough for the
    single-valued keys read here)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / name).read_text().replace("\\\n", " "))
    return parser


def environment_defaults(name: str, *, release: Path | None = None) -> dict[str, str]:
    """The unit's Environment= lines, in order (a later one wins, as in systemd)."""
    text = (UNITS / name).read_text()
    if release is not None:
        text = text.replace(RELEASE, str(release))
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("Environment="):
            env.update(item.split("=", 1) for item in shlex.split(line.removeprefix("Environment=")))
    return env


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_systemd_accepts_every_unit_without_a_warning(tmp_path):
    assert verified(staged(tmp_path)) is None


@pytest.mark.parametrize(
    "breaking",
    [
        ("ProtectSystem=strict", "ProtectSytem=strict"),  # a misspelt key: ignored, with a warning
        ("ProtectSystem=strict", "ProtectSystem=strcit"),  # a value systemd cannot parse: ignored
        ("TimeoutStopSec=30", "TimeoutStopSec=thirty"),
        ("Requires=telemachus-runtime.service", "Requires=telemachus-runtme.service"),  # no such unit
        (".venv/bin/python -m", ".venv/bin/pyhton -m"),  # no such program
    ],
    ids=["unknown-key", "bad-value", "bad-time", "missing-unit", "missing-program"],
)
def test_the_check_fails_on_a_broken_unit(tmp_path, breaking):
    assert verified(staged(tmp_path, breaking=breaking)) is not None


@pytest.mark.parametrize("instance", ["telemachus-api@8001.service", "telemachus-worker@1.service"])
def test_the_services_are_hardened(tmp_path, instance):
    # An exposure of 2.0 or less, out of 10 ("OK" in systemd's words).
    rated = analyze(staged(tmp_path), "security", "--offline=yes", "--threshold=20", instance)
    assert rated.returncode == 0, rated.stdout[-3000:] + rated.stderr


def test_the_units_agree_with_the_app_and_with_each_other():
    api, worker = unit("telemachus-api@.service")["Service"], unit("telemachus-worker@.service")["Service"]
    # The worker's stop outlasts the grace it drains for, with time to give the rest back.
    defaults = environment_defaults("telemachus-worker@.service")
    assert seconds(worker["TimeoutStopSec"]) >= float(defaults["TELEMACHUS_SHUTDOWN_GRACE"]) + 15
    assert worker["KillMode"] == "mixed" and worker["KillSignal"] == "SIGTERM"
    # The API's stop outlasts uvicorn's grace for requests in flight (telemachus/serve.py, 5 s).
    assert seconds(api["TimeoutStopSec"]) >= 5 + 10
    for name, service in (("telemachus-api@.service", api), ("telemachus-worker@.service", worker)):
        # Metrics go where the runtime oneshot empties them and where the read-only system is writable.
        assert environment_defaults(name)["PROMETHEUS_MULTIPROC_DIR"] == "/run/telemachus/prometheus"
        assert service["ReadWritePaths"] == "/run/telemachus" and service["ProtectSystem"] == "strict"
        assert service["StateDirectory"] == "telemachus"  # /var/lib/telemachus: TELEMACHUS_VAR_DIR
        assert service["EnvironmentFile"] == "/etc/telemachus/telemachus.env"
        assert service["User"] == "telemachus"
    runtime = unit("telemachus-runtime.service")["Service"]
    assert "/run/telemachus/prometheus" in runtime["ExecStart"]
    # The instances nginx proxies to.
    nginx = (ROOT / "deploy/nginx/telemachus.conf").read_text()
    assert re.findall(r"server 127\.0\.0\.1:(\d+);", nginx) == ["8001", "8002"]
    assert api["ExecStart"].endswith("-m telemachus.serve 127.0.0.1 %i")


# --- the command lines, run ---------------------------------------------------------------------


def command_line(name: str, *, instance: str, env_file: dict[str, str], release: Path) -> tuple[list[str], dict]:
    """The unit's ExecStart as systemd runs it: the Environment= defaults, then the environment
    file over them; %i, %H and ${NAME} expanded; the release path this checkout."""
    text = (UNITS / name).read_text().replace("\\\n", " ").replace(RELEASE, str(release))
    env = {**environment_defaults(name, release=release), **env_file}
    (exec_start,) = [line.removeprefix("ExecStart=") for line in text.splitlines() if line.startswith("ExecStart=")]
    exec_start = exec_start.replace("%i", instance).replace("%H", socket.gethostname())
    expanded = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], exec_start)
    assert "$" not in expanded and "%" not in expanded, expanded
    return shlex.split(expanded), env


@pytest.fixture
def release(tmp_path) -> Path:
    """/opt/telemachus/current as a host has it: this checkout, with its venv's python."""
    current = tmp_path / "current"
    current.symlink_to(ROOT)
    return current


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_units_command_lines_serve_and_drain(tmp_path, release, make_user, make_team, make_executor):
    # Given the environment file of a host (here: this test's database), with a short grace
    env_file = {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url_for_tests(),
        "TELEMACHUS_SHUTDOWN_GRACE": "1",
        "TELEMACHUS_WORKER_CONCURRENCY": "4",
        "TELEMACHUS_VAR_DIR": str(tmp_path / "var"),
    }
    metrics = tmp_path / "prometheus"
    metrics.mkdir()
    started = []

    def run(name: str, instance: str) -> subprocess.Popen:
        argv, env = command_line(name, instance=instance, env_file=env_file, release=release)
        env = {"PATH": os.environ["PATH"], **env, "PROMETHEUS_MULTIPROC_DIR": str(metrics)}
        log = open(tmp_path / f"{name}.log", "w")
        process = subprocess.Popen(argv, cwd=release, env=env, stdout=log, stderr=subprocess.STDOUT)
        started.append(process)
        return process

    try:
        # When the API unit's command runs as instance <port>
        port = free_port()
        api = run("telemachus-api@.service", str(port))
        # Then it serves there
        wait_until(lambda: responds(f"http://127.0.0.1:{port}/healthz"), timeout=60, what="the API instance")

        # And when the worker unit's command runs, with a job that outlasts the grace
        alice = make_user("alice")
        team = make_team("a", {alice: "member"})
        make_executor("slow", models=["m"], meta={"latency_ms": 60_000})
        job = job_submit(
            user=alice,
            team=team.slug,
            type="chat",
            requirements={"model": "m", "est_tokens": 10},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
        worker = run("telemachus-worker@.service", "1")
        wait_until(lambda: Job.objects.get(pk=job.pk).status == "running", timeout=60, what="the job to run")

        # Then `systemctl stop` (SIGTERM to the main process) drains, gives the job back after the
        # grace, and the worker exits well within TimeoutStopSec
        stop_timeout = seconds(unit("telemachus-worker@.service")["Service"]["TimeoutStopSec"])
        stopping = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=stop_timeout) == 0
        assert time.monotonic() - stopping < 1 + 10
        assert Job.objects.get(pk=job.pk).status == "queued"
        assert JobEvent.objects.filter(job_id=job.pk, event="requeued").exists()

        # And the API stops on SIGTERM within its TimeoutStopSec: uvicorn ends by the signal it was
        # sent once it has closed, which systemd counts as a clean stop (SIGTERM is a clean exit)
        api.send_signal(signal.SIGTERM)
        api_timeout = seconds(unit("telemachus-api@.service")["Service"]["TimeoutStopSec"])
        assert api.wait(timeout=api_timeout) in (0, -signal.SIGTERM)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    shutil.rmtree(metrics, ignore_errors=True)


def test_the_example_environment_file_reads_alike_in_the_shell_and_gives_what_the_units_expand():
    # Given the example file as telemachus-manage reads it (`set -a; . file`)
    example = UNITS / "telemachus.env.example"
    read = subprocess.run(
        ["sh", "-c", f"set -a; . {example}; env -0"], env={}, capture_output=True, text=True, check=True
    ).stdout
    env = dict(item.split("=", 1) for item in read.split("\0") if "=" in item)
    # Then a URL's `&` and `?` stay in its value (systemd strips the same quotes)
    assert env["DATABASE_URL"].endswith("?sslmode=verify-full&sslrootcert=/etc/telemachus/ca.pem")
    assert env["REDIS_URL"].startswith("rediss://") and env["REDIS_URL"].endswith(
        "?ssl_ca_certs=/etc/telemachus/ca.pem"
    )
    # And every ${NAME} the worker unit expands has a value there or in the unit's defaults
    expanded = set(re.findall(r"\$\{(\w+)\}", (UNITS / "telemachus-worker@.service").read_text()))
    assert expanded <= set(env) and expanded <= set(environment_defaults("telemachus-worker@.service"))
    assert "PROMETHEUS_MULTIPROC_DIR" not in env  # the units own it (the runtime oneshot empties it)
