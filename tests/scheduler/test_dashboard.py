"""The live dashboard: the page, its sign-in, and the WebSocket that pushes the queue to it,
through the real ASGI application (session cookie, origin check, consumer)."""

import json

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client

from executors.tools import ToolOutcome
from scheduler.services.claim import job_claim
from scheduler.services.rounds import round_begin, round_finish, round_requeue
from scheduler.services.submit import job_submit
from scheduler.snapshot import dashboard_state
from telemachus.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)


def signed_in(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def socket(session: str | None = None, origin: str = "http://127.0.0.1:8000") -> WebsocketCommunicator:
    headers = [(b"origin", origin.encode())]
    if session:
        headers.append((b"cookie", f"sessionid={session}".encode()))
    return WebsocketCommunicator(application, "/ws/dashboard/", headers=headers)


class TestPage:
    def test_needs_a_sign_in_that_team_members_can_use(self, member_setup):
        browser = Client()
        assert browser.get("/").url == "/dashboard/"
        assert browser.get("/dashboard/").url == "/login/?next=/dashboard/"
        # A member is not admin staff: the dashboard has its own sign-in.
        member_setup[0].set_password("pw")
        member_setup[0].save()
        response = browser.post("/login/?next=/dashboard/", {"username": "alice", "password": "pw"})
        assert response.url == "/dashboard/"
        page = browser.get("/dashboard/")
        assert page.status_code == 200 and b"/ws/dashboard/" in page.content and b"alice" in page.content


class TestSocket:
    def test_pushes_the_queue_and_its_changes(self, member_setup, settings):
        settings.TELEMACHUS_DASHBOARD_INTERVAL_SECONDS = 0.05
        alice = member_setup[0]
        session = signed_in(alice)

        async def scenario():
            communicator = socket(session)
            connected, _ = await communicator.connect()
            assert connected
            first = json.loads(await communicator.receive_from(timeout=5))
            job = await database_sync_to_async(job_submit)(
                user=alice, team="a", type="chat", requirements={"model": "m"},
                input={"messages": [{"role": "user", "content": "hi"}]},
            )
            second = json.loads(await communicator.receive_from(timeout=5))
            await communicator.disconnect()
            return first, second, job

        first, second, job = async_to_sync(scenario)()
        # A member sees their own team only, and their own jobs.
        assert [t["team"] for t in first["state"]["queue"]["teams"]] == ["a"]
        assert first["state"]["jobs"] == [] and first["at"]
        assert second["state"]["queue"]["teams"][0]["queued"] == 1
        assert [(j["id"], j["status"], j["user"]) for j in second["state"]["jobs"]] == [(job.pk, "queued", "alice")]

    def test_refuses_anonymous_users_and_other_sites(self, member_setup):
        session = signed_in(member_setup[0])

        async def scenario():
            anonymous, _ = await socket().connect()
            elsewhere, _ = await socket(session, origin="https://evil.example").connect()
            return anonymous, elsewhere

        assert async_to_sync(scenario)() == (False, False)

    @pytest.mark.parametrize("how", ["deactivated", "signed out"])
    def test_closes_when_the_account_is_deactivated_or_signs_out(self, member_setup, settings, how):
        settings.TELEMACHUS_DASHBOARD_INTERVAL_SECONDS = 0.05
        alice = member_setup[0]
        browser = Client()
        browser.force_login(alice)

        def end() -> None:
            if how == "deactivated":
                type(alice).objects.filter(pk=alice.pk).update(is_active=False)
            else:
                assert browser.post("/logout/").status_code == 302

        async def scenario():
            communicator = socket(browser.cookies["sessionid"].value)
            assert (await communicator.connect())[0]
            await communicator.receive_from(timeout=5)
            await database_sync_to_async(end)()
            return await communicator.receive_output(timeout=5)

        assert async_to_sync(scenario)() == {"type": "websocket.close", "code": 4401}


def test_a_running_flow_shows_its_round(member_setup):
    alice = member_setup[0]
    flow = job_submit(user=alice, team="a", type="flow", requirements={"model": "m"},
                      input={"messages": [{"role": "user", "content": "go"}], "tools": ["echo"]})
    (claim,) = job_claim(worker="w", limit=1).claims
    round_begin(job_id=flow.pk, lease=claim.lease)
    call = {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": "{}"}}
    round_finish(job_id=flow.pk, lease=claim.lease, round=1,
                 message={"role": "assistant", "content": None, "tool_calls": [call]})
    round_requeue(job_id=flow.pk, lease=claim.lease, round=1,
                  results=[ToolOutcome(name="echo", call_id="c1", ok=True, content="{}", seconds=0.0)])
    (job,) = dashboard_state(user=alice)["jobs"]
    assert (job["status"], job["round"], job["round_label"]) == ("queued", 2, "round 2 next")
    job_claim(worker="w", limit=1)
    (job,) = dashboard_state(user=alice)["jobs"]
    assert (job["status"], job["round"], job["round_label"]) == ("running", 2, "round 2")
