"""What `make run` does on a fresh machine, end to end with the real settings: migrate, seed the
demo (twice: it must be idempotent and show the admin password once), then bin/run serves daphne
and a worker; a job submitted over HTTP ends `done` with the simulated reply; Ctrl-C stops both."""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from openai import OpenAI

from tests.processes import ROOT, answers, free_port, wait_until

pytestmark = pytest.mark.slow


def manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def call(url: str, token: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode() if body is not None else None, method="POST" if body else "GET",
        headers={"Authorization": f"Token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=40) as response:
        return json.loads(response.read())


def test_fresh_database_to_a_finished_job_and_a_clean_stop(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "telemachus.settings", "PYTHONUNBUFFERED": "1",
           "DATABASE_URL": f"sqlite:///{tmp_path}/run.sqlite3"}
    env.pop("DEBUG", None)
    manage(env, "migrate", "--noinput")
    first, second = manage(env, "telemachus_demo"), manage(env, "telemachus_demo")
    password = first.split("password (shown once): ")[1].split()[0]
    assert "admin user present" in second and password not in second
    token = manage(env, "drf_create_token", "admin").split()[2]

    port = free_port()
    log = open(tmp_path / "run.log", "w")
    run = subprocess.Popen(["bin/run"], cwd=ROOT, env={**env, "PY": sys.executable, "PORT": str(port)},
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}/api"
        wait_until(lambda: answers(f"{base}/schema/"), timeout=30, what="daphne to listen")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as home:  # the dashboard's sign-in
            assert home.url.endswith("/login/?next=/dashboard/") and b"Sign in" in home.read()
        job = call(f"{base}/jobs/", token, {
            "type": "chat", "team": "demo", "requirements": {"model": "sim", "est_tokens": 50},
            "input": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16},
        })
        assert job["status"] == "queued"
        finished = call(f"{base}/jobs/{job['id']}/wait/?timeout=30", token)
        assert finished["status"] == "done" and finished["result"]["simulated"] is True
        assert finished["result"]["message"]["content"].endswith("Hello")
        # The README's three lines: the demo's sim model through the OpenAI SDK, plain, streamed, embedded.
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0, timeout=40)
        reply = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hello"}])
        assert reply.choices[0].message.content.endswith("Hello") and reply.usage.total_tokens > 0
        streamed = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hi"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).endswith("Hi")
        assert len(client.embeddings.create(model="sim", input="Hello").data[0].embedding) == 8
    finally:
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        code = run.wait(timeout=30)
    assert code == 0, (tmp_path / "run.log").read_text()
    assert not answers(f"http://127.0.0.1:{port}/api/schema/")

