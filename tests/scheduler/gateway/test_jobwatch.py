"""GET /api/jobs/{id}/wait/ and /stream/ on a running server: they wake on the job feed, show only
what the caller may see, and the stream relays a job's output while its model is still writing,
across API processes."""

import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
from django.test import Client

from executors.models import Executor
from scheduler.models import Job
from scheduler.services.retention import job_missing
from scheduler.services.submit import job_submit
from tests.conftest import chat_body
from tests.scheduler.gateway.conftest import may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def submit(user, *, stream: bool = False, team: str = "a") -> Job:
    body = chat_body(team)
    return job_submit(
        user=user,
        team=team,
        type=body["type"],
        requirements=body["requirements"],
        input={**body["input"], **({"stream": True} if stream else {})},
    )


def events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """(event, data) pairs of a Server-Sent Events response, as they arrive."""
    event, data = None, []
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data.append(line.removeprefix("data: "))
        elif not line and event:
            yield event, json.loads("\n".join(data))
            event, data = None, []


def auth(user) -> dict[str, str]:
    return {"Authorization": f"Token {token(user)}"}


class TestWait:
    def test_answers_when_the_job_ends(self, stack, alice):
        stack.executor(stack.trickle)
        job = submit(alice)
        response = httpx.get(f"{stack.base}/api/jobs/{job.pk}/wait/?timeout=60", headers=auth(alice), timeout=90)
        assert response.status_code == 200
        assert response.json()["status"] == "done" and response.json()["result"]["message"]["content"].endswith("sim7")

    def test_answers_at_the_timeout_with_the_job_as_it_is(self, stack, alice):
        stack.executor(stack.slow)
        job = submit(alice)
        response = httpx.get(f"{stack.base}/api/jobs/{job.pk}/wait/?timeout=0.5", headers=auth(alice), timeout=30)
        assert response.status_code == 200 and response.json()["status"] in ("queued", "running")

    @pytest.mark.parametrize("query", ["?timeout=-1", "?timeout=301", "?timeout=soon"])
    def test_a_bad_timeout(self, stack, alice, query):
        job = idle_job(alice)
        response = httpx.get(f"{stack.base}/api/jobs/{job.pk}/wait/{query}", headers=auth(alice))
        assert response.status_code == 400 and "timeout" in response.json()["fields"]


def idle_job(user, team: str = "a") -> Job:
    """A job that stays queued: the only executor for it is disabled right after the submit."""
    executor = Executor.objects.create(name=f"idle-{uuid.uuid4().hex[:6]}", kind="sim", capabilities={"models": ["m"]})
    job = submit(user, team=team)
    Executor.objects.filter(pk=executor.pk).update(enabled=False)
    return job


class TestWhoMaySee:
    @pytest.mark.parametrize("action", ["wait/?timeout=0", "stream/"])
    def test_other_teams_jobs_are_not_found(self, stack, alice, member_setup, action):
        bob = may_chat(member_setup[1])
        bobs = idle_job(bob, "b")
        response = httpx.get(f"{stack.base}/api/jobs/{bobs.pk}/{action}", headers=auth(alice))
        assert response.status_code == 404 and response.json() == {
            "error": "not_found",
            "detail": job_missing(bobs.pk),
        }

    @pytest.mark.parametrize("headers", [{}, {"Authorization": "Token nope"}, {"Authorization": "Basic YTpi"}])
    @pytest.mark.parametrize("action", ["wait/?timeout=0", "stream/"])
    def test_no_credentials(self, stack, alice, headers, action):
        job = idle_job(alice)
        response = httpx.get(f"{stack.base}/api/jobs/{job.pk}/{action}", headers=headers)
        assert response.status_code == 401 and response.json()["error"] == "not_authenticated"

    def test_a_signed_in_session_will_do(self, stack, alice):
        job = idle_job(alice)
        browser = Client()
        browser.force_login(alice)
        cookie = browser.cookies["sessionid"].value
        response = httpx.get(f"{stack.base}/api/jobs/{job.pk}/wait/?timeout=0", cookies={"sessionid": cookie})
        assert response.status_code == 200 and response.json()["id"] == job.pk

    def test_other_methods(self, stack, alice):
        job = idle_job(alice)
        response = httpx.post(f"{stack.base}/api/jobs/{job.pk}/wait/", headers=auth(alice))
        assert response.status_code == 405 and response.json()["error"] == "method_not_allowed"
        # A signed-in browser session without a CSRF token (a reported case) gets the same JSON 405.
        browser = Client()
        browser.force_login(alice)
        response = httpx.post(
            f"{stack.base}/api/jobs/{job.pk}/wait/", cookies={"sessionid": browser.cookies["sessionid"].value}
        )
        assert response.status_code == 405 and response.json()["error"] == "method_not_allowed"


def test_a_stream_of_a_finished_job_is_its_history(stack, alice):
    stack.executor(stack.simllm)
    job = submit(alice)
    httpx.get(f"{stack.base}/api/jobs/{job.pk}/wait/?timeout=60", headers=auth(alice), timeout=90)
    with httpx.stream("GET", f"{stack.base}/api/jobs/{job.pk}/stream/", headers=auth(alice), timeout=30) as response:
        seen = list(events(response))
    assert [name for name, _ in seen] == ["job", "event", "event", "event", "event", "done"]
    assert [data["event"] for name, data in seen if name == "event"] == ["queued", "placed", "started", "finished"]
    assert seen[-1][1]["status"] == "done"
    with httpx.stream(
        "GET",
        f"{stack.base}/api/jobs/{job.pk}/stream/",
        timeout=30,
        headers={**auth(alice), "Last-Event-ID": str(seen[1][1]["id"])},
    ) as response:
        resumed = [data["event"] for name, data in events(response) if name == "event"]
    assert resumed == ["placed", "started", "finished"]
