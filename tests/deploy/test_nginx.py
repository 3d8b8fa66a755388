"""deploy/nginx/telemachus.conf in front of the app, as a deployment runs it: Debian's nginx with a
self-signed certificate terminating TLS for two API processes (telemachus/serve.py, the command of
deploy/systemd/telemachus-api@.service) with production settings (DEBUG=0, BEHIND_TLS_PROXY=1,
static files collected), against the test database. Through the proxy, over HTTPS:

* a streamed /v1/chat/completions answer (the official OpenAI SDK) and a job's event stream arrive
  piece by piece as a slow model server writes them, not in one piece at the end;
* the dashboard signs in with its form and its WebSocket opens and receives pushes;
* the app's links are https:// with the proxy's host and port, and its responses carry HSTS;
* both API processes serve; a body over the app's limit gets the app's JSON 413.

PostgreSQL: the output of a job run by a worker reaches the API process that streams it through
NOTIFY (on SQLite only at the end, without Redis)."""

import json
import re
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from django.conf import settings
from openai import OpenAI
from websockets.sync.client import connect as websocket_connect

from executors.models import Executor
from scheduler.models import Job
from tests.conftest import chat_body
from tests.credentials import token_for
from tests.deploy.certs import certificates_make
from tests.deploy.nginx import nginx_start
from tests.processes import ROOT, Processes, wait_until
from tests.scheduler.gateway.conftest import may_chat

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# The model writes 8 words, a quarter of a second apart: two seconds from the first to the last.
WORDS, WORDS_PER_SECOND = 8, 4


def production_env(var) -> dict[str, str]:
    """What an API host behind the proxy is given (docs/deploy.md)."""
    return {
        "DEBUG": "0",
        # Token digests are keyed by it: the test makes its tokens under the test settings' key.
        "SECRET_KEY": settings.SECRET_KEY,
        "ALLOWED_HOSTS": "127.0.0.1",
        "BEHIND_TLS_PROXY": "1",
        "TELEMACHUS_VAR_DIR": str(var),
    }


@pytest.fixture(scope="module")
def proxied(django_db_setup, django_db_blocker, tmp_path_factory):
    """nginx (deploy/nginx/telemachus.conf) in front of two API processes, and a slow model server."""
    workdir = tmp_path_factory.mktemp("proxied")
    processes = Processes(workdir)
    certs = certificates_make(workdir / "tls")
    env = production_env(workdir / "var")
    nginx = None
    try:
        with django_db_blocker.unblock():
            subprocess.run(
                [sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"],
                cwd=ROOT,
                env=processes.env(**env),
                check=True,
            )
            apis = [processes.api_server(f"api{n}", **env) for n in (1, 2)]
            model = processes.simllm(latency_ms=50, models="m", output_tokens=WORDS, tokens_per_s=WORDS_PER_SECOND)
            nginx = nginx_start(upstreams=[int(api.rsplit(":", 1)[1]) for api in apis], certs=certs)
            yield dict(nginx=nginx, apis=apis, model=model, ca=certs.ca, processes=processes)
    finally:
        if nginx is not None:
            nginx.stop()
        processes.stop_all()


@pytest.fixture
def site(proxied, processes, make_user, make_team):
    """A member of team `a` with a token, an executor on the slow model server, and a worker."""
    alice = make_user("alice", is_staff=True)
    alice.set_password("pw")
    alice.save()
    make_team("a", {alice: "member"})
    # Granted directly: the servers outlive the test's database flush (may_chat says why).
    may_chat(alice)
    Executor.objects.create(
        name="slow", kind="local-model", endpoint=f"{proxied['model']}/v1", capabilities={"models": ["m"]}
    )
    processes.worker("w1", concurrency=8)
    return dict(proxied, user=alice, token=token_for(alice))


def https(site) -> httpx.Client:
    return httpx.Client(base_url=site["nginx"].base, verify=trusting(site), timeout=30)


def trusting(site) -> ssl.SSLContext:
    """A client's TLS context that trusts the test's certificate authority (and only it)."""
    return ssl.create_default_context(cafile=str(site["ca"]))


def test_a_streamed_v1_answer_arrives_through_the_proxy_as_the_model_writes_it(site):
    # Given the official SDK pointed at the proxy's HTTPS address, trusting the test's authority
    client = OpenAI(base_url=f"{site['nginx'].base}/v1", api_key=site["token"], http_client=https(site), max_retries=0)

    # When a streamed chat completion is read through it
    started = time.monotonic()
    arrivals = []
    for chunk in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello"}], stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append((time.monotonic() - started, chunk.choices[0].delta.content))

    # Then every word came, and the first long before the last: nothing held the stream back
    text = "".join(piece for _, piece in arrivals)
    assert text.endswith(" ".join(f"sim{i}" for i in range(WORDS))), text
    first, last = arrivals[0][0], arrivals[-1][0]
    writing = (WORDS - 1) / WORDS_PER_SECOND
    assert last - first >= 0.75 * writing, f"first piece at {first:.2f}s, last at {last:.2f}s: buffered"
    assert len({round(at, 1) for at, _ in arrivals}) >= WORDS // 2, arrivals


def test_a_jobs_event_stream_arrives_through_the_proxy_as_the_worker_relays_it(site):
    # Given a chat job submitted through the proxy, run by the worker on the slow model server
    with https(site) as client:
        headers = {"Authorization": f"Token {site['token']}"}
        streamed = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "stream": True}
        submitted = client.post("/api/jobs/", json=chat_body("a", model="m", input=streamed), headers=headers)
        assert submitted.status_code == 201, submitted.text
        job_id = submitted.json()["id"]

        # When its stream is read through the proxy
        started, deltas = time.monotonic(), []
        with client.stream("GET", f"/api/jobs/{job_id}/stream/", headers=headers) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            event = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event == "delta":
                    deltas.append(time.monotonic() - started)
                elif line.startswith("data: ") and event == "done":
                    break

    # Then its output came in pieces, spread over the model's writing
    assert len(deltas) >= 3, deltas
    assert deltas[-1] - deltas[0] >= 0.75 * (WORDS - 1) / WORDS_PER_SECOND, deltas
    assert Job.objects.get(pk=job_id).status == "done"


def test_the_dashboard_signs_in_and_its_socket_gets_pushes_through_the_proxy(site):
    nginx = site["nginx"]
    origin = nginx.base
    with https(site) as browser:
        # Given the dashboard's sign-in form, posted through the proxy as a browser does
        form = browser.get("/login/")
        assert form.status_code == 200
        csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
        signed_in = browser.post(
            "/login/?next=/dashboard/",
            data={"username": "alice", "password": "pw", "csrfmiddlewaretoken": csrf},
            headers={"Origin": origin, "Referer": f"{origin}/login/"},
        )
        # Then the app accepted the form's origin (scheme, host and port as the proxy passed them)
        assert signed_in.status_code == 302 and signed_in.headers["location"] == "/dashboard/", signed_in.text[:500]
        session = browser.cookies["sessionid"]

        # When the page's socket opens through the proxy (wss://, the page's own origin)
        with websocket_connect(
            f"wss://127.0.0.1:{nginx.https_port}/ws/dashboard/",
            ssl=trusting(site),
            origin=origin,
            additional_headers={"Cookie": f"sessionid={session}"},
            open_timeout=10,
        ) as socket:
            # Then it receives the dashboard's state
            first = json.loads(socket.recv(timeout=10))
            assert "state" in first, first

            # And a change made meanwhile (a job queued, through the proxy) is pushed to it
            submitted = browser.post(
                "/api/jobs/",
                json=chat_body("a", model="m", input={"messages": [{"role": "user", "content": "hi"}]}),
                headers={"Authorization": f"Token {site['token']}"},
            )
            assert submitted.status_code == 201, submitted.text
            job_id = submitted.json()["id"]

            def pushed_with_the_job() -> bool:
                message = json.loads(socket.recv(timeout=10))
                return "state" in message and f'"id": {job_id}' in json.dumps(message["state"])

            wait_until(pushed_with_the_job, timeout=20, interval=0, what="a push naming the new job")


def test_the_app_behind_the_proxy_links_https_and_sends_hsts(site):
    nginx = site["nginx"]
    headers = {"Authorization": f"Token {site['token']}"}
    with https(site) as client:
        for _ in range(2):
            assert client.post("/api/jobs/", json=chat_body("a", model="m"), headers=headers).status_code == 201

        # An absolute URL the app builds (the next page's link) is https:// on the proxy's host and port
        page = client.get("/api/jobs/?page_size=1", headers=headers)
        assert page.status_code == 200
        assert page.json()["next"].startswith(f"https://127.0.0.1:{nginx.https_port}/api/jobs/?cursor="), page.json()

        # HSTS from Django's pages and from the paths served ahead of Django (/v1/)
        for path in ("/api/queue/", "/v1/models"):
            response = client.get(path, headers=headers)
            assert response.status_code == 200, (path, response.text)
            assert response.headers["strict-transport-security"] == "max-age=31536000; includeSubDomains; preload"

    # Plain HTTP to the proxy is redirected to HTTPS, never served
    plain = httpx.get(f"http://127.0.0.1:{nginx.http_port}/api/queue/", headers=headers)
    assert plain.status_code == 301 and plain.headers["location"] == "https://127.0.0.1/api/queue/"

    # What the proxy's header changes: straight to an API process, without it, the app insists on HTTPS
    api = site["apis"][0]
    direct = httpx.get(f"{api}/api/queue/", headers={**headers, "Host": "127.0.0.1"})
    assert direct.status_code == 301 and direct.headers["location"] == "https://127.0.0.1/api/queue/"
    assert "strict-transport-security" not in direct.headers
    assert httpx.get(f"{api}/v1/models", headers=headers).status_code == 403


def test_both_api_processes_serve_and_the_apps_body_limit_answers(site):
    headers = {"Authorization": f"Token {site['token']}"}
    with https(site) as client:
        for _ in range(6):
            assert client.get("/api/queue/", headers=headers).status_code == 200

        # A body over TELEMACHUS_MAX_BODY_BYTES passes nginx and is refused by the app, in its shape
        limit = 1_048_576
        big = {"type": "chat", "team": "a", "input": {"text": "x" * (limit + limit // 2)}}
        refused = client.post("/api/jobs/", json=big, headers=headers)
        assert refused.status_code == 413 and refused.json()["error"] == "payload_too_large", refused.text[:300]
        bearer = {"Authorization": f"Bearer {site['token']}"}
        openai_refused = client.post("/v1/chat/completions", json=big, headers=bearer)
        assert openai_refused.status_code == 413 and openai_refused.json()["error"]["code"] == "payload_too_large"
        # Far beyond it, nginx stops the body itself
        assert client.post("/api/jobs/", content=b"x" * (3 * limit), headers=headers).status_code == 413

    upstreams = set(re.findall(r"upstream=(127\.0\.0\.1:\d+)", site["nginx"].access_log.read_text()))
    assert upstreams == {api.removeprefix("http://") for api in site["apis"]}, upstreams


def test_a_batch_file_past_the_body_limit_uploads_through_the_proxy(site):
    # Given a batch input file of about 3 MiB (past nginx's 2m and the app's 1 MiB for other bodies)
    client = OpenAI(base_url=f"{site['nginx'].base}/v1", api_key=site["token"], http_client=https(site), max_retries=0)
    line = {"method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "max_tokens": 4}}
    text = "".join(
        json.dumps(
            {
                **line,
                "custom_id": f"line-{i}",
                "body": {**line["body"], "messages": [{"role": "user", "content": "x" * 1000}]},
            }
        )
        + "\n"
        for i in range(3000)
    )
    assert len(text) > 3 * 1_048_576 - 100_000

    # When it is uploaded through the proxy with the official SDK
    uploaded = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")

    # Then the app stored it whole
    assert uploaded.bytes == len(text) and client.files.content(uploaded.id).text == text
