"""The live dashboard: the page, its sign-in, and the WebSocket that pushes the queue to it,
through the real ASGI application (session cookie, origin check, consumer)."""

import json
import re
import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.test import Client
from django.utils import timezone

from executors.models import Executor
from executors.tools import ToolOutcome
from scheduler.live.snapshot import dashboard_state
from scheduler.models import Job, JobEvent, QueuePolicy, QueueSample
from scheduler.services.claim import job_claim
from scheduler.services.history import bucket_start
from scheduler.services.rounds import round_finish, round_requeue
from scheduler.services.submit import job_submit
from telemachus.asgi import application
from telemachus.models import AuditEvent, FeatureSwitch, Team

pytestmark = pytest.mark.django_db(transaction=True)


def signed_in(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def socket(session: str | None = None, origin: str = "http://127.0.0.1:8000") -> WebsocketCommunicator:
    headers = [(b"host", b"127.0.0.1:8000"), (b"origin", origin.encode())]
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
        assert (
            page.status_code == 200 and b"/static/scheduler/dashboard.js" in page.content and b"alice" in page.content
        )
        # No inline script, handler or style, so a Content-Security-Policy can forbid them.
        assert b"<script>" not in page.content and not re.search(rb"\son[a-z]+=", page.content)
        assert b"style=" not in page.content and b"<style" not in page.content

    def test_scripts_and_the_chart_library_come_from_this_site(self, member_setup):
        """The page's Content-Security-Policy allows scripts from this site only (neither inline
        nor eval), and every script it loads, uPlot included, is one of its static files."""
        browser = Client()
        browser.force_login(member_setup[0])
        page = browser.get("/dashboard/")
        policy = page.headers["Content-Security-Policy"]
        scripts = re.findall(rb'<script src="([^"]+)"', page.content)
        script_src = next(d for d in policy.split("; ") if d.startswith("script-src "))
        assert script_src.split()[1] == "'self'" and "unsafe" not in script_src and "connect-src 'self'" in policy
        assert b"/static/scheduler/vendor/uplot-1.6.32/uPlot.iife.min.js" in scripts
        assert all(src.startswith(b"/static/scheduler/") for src in scripts), scripts


class TestSocket:
    def test_pushes_the_queue_and_its_changes(self, member_setup, settings):
        settings.TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = 0.2
        alice = member_setup[0]
        session = signed_in(alice)

        async def scenario():
            communicator = socket(session)
            connected, _ = await communicator.connect()
            assert connected
            first = json.loads(await communicator.receive_from(timeout=5))
            job = await database_sync_to_async(job_submit)(
                user=alice,
                team="a",
                type="chat",
                requirements={"model": "m"},
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
        settings.TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = 0.2
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


async def receive_state(communicator, timeout=5.0, where=lambda state: True):
    """The next pushed state that satisfies `where` (heartbeats and replies are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        message = json.loads(await communicator.receive_from(timeout=max(deadline - time.monotonic(), 0.01)))
        if "state" in message and where(message["state"]):
            return message["state"]


async def receive_reply(communicator, timeout=5.0):
    while True:
        message = json.loads(await communicator.receive_from(timeout=timeout))
        if "reply" in message:
            return message


def run(scenario):
    return async_to_sync(scenario)()


class TestOperatorActions:
    """An operator acts from the dashboard: the same services and checks as the API, audited as
    coming from the dashboard, and every open dashboard sees the result within a second."""

    @pytest.fixture
    def sockets(self, operator, member_setup, settings):
        settings.TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = 2
        return signed_in(operator), signed_in(member_setup[0])

    def test_team_weight_and_executor_capacity_reach_every_open_dashboard(self, sockets, member_setup):
        operator_session, member_session = sockets
        executor = member_setup[4]

        async def scenario():
            acting, watching = socket(operator_session), socket(member_session)
            assert (await acting.connect())[0] and (await watching.connect())[0]
            await receive_state(acting)
            await receive_state(watching)
            started = time.monotonic()
            await acting.send_json_to({"id": 1, "action": "policy.update", "changes": {"team_weights": {"a": 3}}})
            reply = await receive_reply(acting)
            seen = await receive_state(watching, where=lambda s: s["queue"]["teams"][0]["weight"] == 3.0)
            weight_latency = time.monotonic() - started
            await acting.send_json_to(
                {
                    "id": 2,
                    "action": "executor.update",
                    "executor": executor.pk,
                    "changes": {"max_concurrency": 7, "enabled": False},
                }
            )
            second = await receive_reply(acting)
            shown = await receive_state(acting, where=lambda s: s["queue"]["executors"][0]["max_concurrency"] == 7)
            await acting.disconnect()
            await watching.disconnect()
            return reply, seen, weight_latency, second, shown

        reply, seen, latency, second, shown = run(scenario)
        assert reply == {"reply": 1, "ok": True} and second == {"reply": 2, "ok": True}
        assert seen["operator"] is False and latency < 1.5
        assert shown["queue"]["executors"][0]["enabled"] is False and shown["operator"] is True
        assert QueuePolicy.objects.get().team_weights == {"a": 3.0}
        assert Executor.objects.filter(pk=executor.pk, max_concurrency=7, enabled=False).exists()
        events = {e.action: e for e in AuditEvent.objects.filter(actor__username="operator")}
        assert {e.source for e in events.values()} == {"dashboard"}
        assert events["executor.update"].before == {"max_concurrency": 4, "enabled": True}
        assert events["queue_policy.update"].after == {"team_weights": {"a": 3.0}}

    def test_cancel_requeue_and_feature_switch(self, sockets, member_setup):
        operator_session, _ = sockets
        job = job_submit(
            user=member_setup[0],
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )

        async def scenario():
            communicator = socket(operator_session)
            await communicator.connect()
            await receive_state(communicator)
            replies = []
            for request in (
                {"action": "job.cancel", "job": job.pk},
                {"action": "job.cancel", "job": job.pk},  # already canceled: 409
                {"action": "job.requeue", "job": job.pk},
                {"action": "feature.set", "changes": {"feature": "tool", "team": "a", "enabled": False}},
                {"action": "policy.update", "changes": {"placement": "random"}},  # the API's validation
                {"action": "executor.update", "executor": member_setup[4].pk, "changes": {"kind": "sim"}},
                {"action": "reboot"},
            ):
                await communicator.send_json_to(request)
                replies.append(await receive_reply(communicator))
            await communicator.disconnect()
            return replies

        cancel, again, requeue, feature, bad_policy, bad_executor, unknown = run(scenario)
        assert cancel["ok"] and requeue["ok"] and feature["ok"]
        assert again["error"]["error"] == "conflict"
        assert bad_policy["error"]["error"] == "validation_error" and "placement" in bad_policy["error"]["fields"]
        assert bad_executor["error"]["fields"] == {"changes": ["Change one or more of: enabled, max_concurrency."]}
        assert unknown["error"]["error"] == "validation_error"
        assert Job.objects.get().status == "queued"
        assert FeatureSwitch.objects.get().enabled is False
        actions = list(AuditEvent.objects.filter(source="dashboard").values_list("action", flat=True))
        assert sorted(actions) == ["feature.set", "job.cancel", "job.requeue"]

    def test_a_members_socket_refuses_actions(self, sockets, member_setup):
        _, member_session = sockets
        job = job_submit(
            user=member_setup[0],
            team="a",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )

        async def scenario():
            communicator = socket(member_session)
            await communicator.connect()
            state = await receive_state(communicator)
            replies = []
            for request in (
                {"id": "w", "action": "policy.update", "changes": {"team_weights": {"a": 9}}},
                {"id": "c", "action": "job.cancel", "job": job.pk},
            ):
                await communicator.send_json_to(request)
                replies.append(await receive_reply(communicator))
            await communicator.disconnect()
            return state, replies

        state, replies = run(scenario)
        assert state["operator"] is False
        assert [(r["reply"], r["ok"], r["error"]["error"]) for r in replies] == [
            ("w", False, "forbidden"),
            ("c", False, "forbidden"),
        ]
        assert QueuePolicy.objects.filter(team_weights={"a": 9}).count() == 0
        assert Job.objects.get().status == "queued" and not AuditEvent.objects.filter(source="dashboard").exists()


class TestPushes:
    def test_idle_dashboards_get_heartbeats_not_re_reads(self, member_setup, settings):
        settings.TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = 0.2
        session = signed_in(member_setup[0])

        async def scenario():
            communicator = socket(session)
            await communicator.connect()
            messages = [json.loads(await communicator.receive_from(timeout=5)) for _ in range(4)]
            await communicator.disconnect()
            return messages

        first, *beats = run(scenario)
        assert "state" in first
        assert all(set(beat) == {"at"} for beat in beats), "nothing changed, so only the stamp moves"
        stamps = [beat["at"] for beat in beats]
        assert stamps == sorted(stamps) and len(set(stamps)) == 3

    def test_the_job_list_says_how_many_of_how_many_and_links(self, member_setup, operator):
        from scheduler.live.snapshot import RECENT_JOBS, dashboard_state

        alice = member_setup[0]
        for _ in range(RECENT_JOBS + 3):
            Job.objects.create(type="chat", user=alice, team=member_setup[2], model="m", requirements={"model": "m"})
        state = dashboard_state(user=operator)
        assert len(state["jobs"]) == RECENT_JOBS and state["jobs_total"] == RECENT_JOBS + 3
        assert state["jobs_link"] == "/admin/scheduler/job/"
        assert state["jobs"][0]["link"] == f"/admin/scheduler/job/{state['jobs'][0]['id']}/change/"
        mine = dashboard_state(user=alice)
        assert mine["jobs_total"] == RECENT_JOBS + 3 and mine["jobs"][0]["link"].startswith("/api/jobs/")


def test_the_queue_wait_is_the_open_buckets_so_far_and_the_longest_still_queued(member_setup, operator, settings):
    """Given a closed bucket whose jobs waited 0.01 s, three jobs that started in the open bucket
    after waiting 4.9 s, and a job queued for 5 s already: the dashboard's state holds the open
    bucket's waits so far (the measure its row will hold when it closes, which the wait tile and the
    wait chart's live edge show) and when the job waiting longest entered the queue."""
    settings.TELEMACHUS_HISTORY_BUCKET_SECONDS = 86_400  # the open bucket: today (UTC), whatever the minute
    alice, _, team_a, _, _ = member_setup
    now = timezone.now()
    QueueSample.objects.create(at=bucket_start(now) - timedelta(days=1), values={"wait_p95": 0.01, "wait_p50": 0.01})
    for _ in range(3):
        started = now - timedelta(seconds=1)
        job = Job.objects.create(
            type="chat",
            user=alice,
            team=team_a,
            model="m",
            status=Job.Status.DONE,
            submitted_at=started - timedelta(seconds=4.9),
            started_at=started,
            finished_at=now,
        )
        JobEvent.objects.create(job=job, event=JobEvent.Type.STARTED, at=started)
    waiting = job_submit(
        user=alice,
        team="a",
        type="chat",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "x"}]},
    )
    entered = now - timedelta(seconds=5)
    Job.objects.filter(pk=waiting.pk).update(queued_at=entered)

    waits = dashboard_state(user=operator)["waits"]
    assert waits == {
        "since": bucket_start(now),
        "started": 3,
        "wait_p50": 4.9,
        "wait_p95": 4.9,
        "oldest_queued_at": entered,
    }
    assert dashboard_state(user=alice)["waits"]["wait_p95"] == 4.9, "the whole queue's, like the history's"


def test_a_running_flow_shows_its_round(member_setup):
    alice = member_setup[0]
    flow = job_submit(
        user=alice,
        team="a",
        type="flow",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "go"}], "tools": ["echo"]},
    )
    (claim,) = job_claim(worker="w", limit=1).claims  # the claim starts round 1
    call = {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": "{}"}}
    round_finish(
        job_id=flow.pk, lease=claim.lease, round=1, message={"role": "assistant", "content": None, "tool_calls": [call]}
    )
    round_requeue(
        job_id=flow.pk,
        lease=claim.lease,
        round=1,
        results=[ToolOutcome(name="echo", call_id="c1", ok=True, content="{}", seconds=0.0)],
    )
    (job,) = dashboard_state(user=alice)["jobs"]
    assert (job["status"], job["round"], job["round_label"]) == ("queued", 2, "round 2 next")
    job_claim(worker="w", limit=1)
    (job,) = dashboard_state(user=alice)["jobs"]
    assert (job["status"], job["round"], job["round_label"]) == ("running", 2, "round 2")


class TestMembersSeeOnlyTheirTeams:
    """A member of one team must not learn another team's slug, weight, depth cap, priority or
    people from any view of the queue: the dashboard's socket, GET /api/queue/, GET /api/policy/.
    Operators see it all. The other team's names are distinctive so a leak anywhere shows."""

    @pytest.fixture
    def two_teams(self, make_user, make_team, make_executor, operator):
        alice, secretbob = make_user("alice"), make_user("secretbob")
        make_team("alpha", {alice: "member"})
        make_team("secretteam", {secretbob: "member"})
        make_executor("shared", models=["m"])
        make_executor("secretexec", models=["m"], team=Team.objects.get(slug="secretteam"))
        QueuePolicy.objects.update_or_create(
            pk=QueuePolicy.SINGLETON_ID,
            defaults={
                "team_weights": {"alpha": 2.0, "secretteam": 7.0},
                "max_queue_depth": {"default": 100, "alpha": 50, "secretteam": 9},
                "priority_map": {"member": 0, "team:alpha": 1, "team:secretteam": 5, "user:secretbob": 3},
            },
        )
        job_submit(
            user=secretbob,
            team="secretteam",
            type="chat",
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
        return alice, operator

    def test_dashboard_socket(self, two_teams):
        alice, operator = two_teams

        def first_state(user):
            session = signed_in(user)

            async def scenario():
                communicator = socket(session)
                assert (await communicator.connect())[0]
                state = await receive_state(communicator)
                await communicator.disconnect()
                return state

            return run(scenario)

        mine = first_state(alice)
        assert "secret" not in json.dumps(mine)
        assert mine["policy"]["team_weights"] == {"alpha": 2.0}
        assert mine["policy"]["max_queue_depth"] == {"default": 100, "alpha": 50}
        assert mine["policy"]["priority_map"] == {"member": 0, "team:alpha": 1}
        everything = first_state(operator)
        assert everything["policy"]["team_weights"] == {"alpha": 2.0, "secretteam": 7.0}
        assert "secretexec" in json.dumps(everything["queue"])

    def test_http_views(self, two_teams, api):
        alice, operator = two_teams
        for path in ("/api/queue/", "/api/policy/"):
            response = api(alice).get(path)
            assert response.status_code == 200 and "secret" not in response.content.decode(), path
            assert "secret" in api(operator).get(path).content.decode(), path
