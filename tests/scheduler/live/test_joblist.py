"""The dashboard's job list (scheduler/live/joblist.py): running first, tabs, filters, keyset pages,
and the socket message that chooses them."""

import json

import pytest
from django.test import Client

from scheduler.live.joblist import JobView, JobViewInput, jobs_page
from scheduler.live.snapshot import dashboard_state
from scheduler.models import Job
from scheduler.services.claim import job_claim
from tests.scheduler.test_dashboard import receive_reply, receive_state, run, socket

pytestmark = pytest.mark.django_db(transaction=True)


def ids(page) -> list[int]:
    return [job.pk for job in page["jobs"]]


@pytest.fixture
def burst(member_setup, submit, make_executor):
    """Given 12 jobs of team a and 6 of team b queued, then 4 claimed (running: the oldest of each
    team's head of line), 2 done and 1 failed: a job list where the running ones are the oldest."""
    alice, bob, team_a, team_b, executor = member_setup
    make_executor("other", models=["n"])
    jobs = [submit(alice, team_a) for _ in range(12)] + [submit(bob, team_b) for _ in range(6)]
    jobs += [submit(alice, team_a, model="n")]
    running = [claim.job.pk for claim in job_claim(worker="w", limit=4).claims]
    Job.objects.filter(pk__in=[jobs[10].pk, jobs[11].pk]).update(status=Job.Status.DONE)
    Job.objects.filter(pk=jobs[17].pk).update(status=Job.Status.FAILED, error="model server said no")
    return jobs, sorted(running, reverse=True)


class TestPage:
    def test_running_first_then_queued_then_the_rest_newest_first(self, burst, operator):
        jobs, running = burst
        page = jobs_page(user=operator, view=JobView(size=100))
        groups = [{"running": 0, "queued": 1}.get(job.status, 2) for job in page["jobs"]]
        assert ids(page)[: len(running)] == running
        assert groups == sorted(groups)
        for group in (0, 1, 2):
            within = [job.pk for job, g in zip(page["jobs"], groups, strict=True) if g == group]
            assert within == sorted(within, reverse=True)
        assert page["counts"] == {"all": 19, "active": 16, "running": 4, "queued": 12, "ended": 3, "failed": 1}
        assert page["next"] is None

    def test_pages_follow_each_other_across_the_groups(self, burst, operator):
        everything = ids(jobs_page(user=operator, view=JobView(size=100)))
        seen, after = [], None
        while True:
            page = jobs_page(user=operator, view=JobView(size=5, after=after))
            seen += ids(page)
            if page["next"] is None:
                break
            after = tuple(page["next"])
        assert seen == everything

    @pytest.mark.parametrize(
        ("view", "expect"),
        [
            (JobView(tab="running"), lambda j: j.status == "running"),
            (JobView(tab="queued", team="b"), lambda j: j.status == "queued" and j.team.slug == "b"),
            (JobView(tab="ended"), lambda j: j.status in ("done", "failed", "canceled")),
            (JobView(model="n"), lambda j: j.model == "n"),
            (JobView(executor="shared"), lambda j: j.executor is not None and j.executor.name == "shared"),
            (JobView(type="flow"), lambda j: False),
        ],
    )
    def test_tabs_and_filters(self, burst, operator, view, expect):
        page = jobs_page(user=operator, view=view)
        every = [j for j in Job.objects.select_related("team", "executor") if expect(j)]
        assert sorted(ids(page)) == sorted(j.pk for j in every) and page["total"] == len(every)

    def test_members_page_through_their_own_jobs_only(self, burst, member_setup):
        bob = member_setup[1]
        page = jobs_page(user=bob, view=JobView())
        assert {job.team.slug for job in page["jobs"]} == {"b"} and page["counts"]["all"] == 6

    def test_the_view_is_checked(self):
        assert JobViewInput(data={"tab": "all", "after": [1, 5], "size": 10}).is_valid()
        for bad in ({"tab": "everything"}, {"size": 0}, {"size": 201}, {"after": [9, 1]}, {"after": [0]}, {"x": 1}):
            assert not JobViewInput(data=bad).is_valid(), bad

    def test_the_snapshot_carries_the_page_and_its_view(self, burst, operator):
        state = dashboard_state(user=operator, view=JobView(tab="failed"))
        assert [j["error"] for j in state["jobs"]] == ["model server said no"]
        assert state["jobs_view"]["tab"] == "failed" and state["jobs_total"] == 1
        assert state["jobs_counts"]["running"] == 4 and state["jobs_next"] is None


def test_idle_teams_say_what_share_they_would_get(member_setup, submit, operator):
    """Given team a busy and team b idle, each with weight 1: a's target share is all of it; b's
    is 0 while idle, and half if it had work now."""
    submit(member_setup[0], member_setup[2])
    teams = {t["team"]: t for t in dashboard_state(user=operator)["queue"]["teams"]}
    assert (teams["a"]["target_share"], teams["a"]["share_if_busy"]) == (1.0, 1.0)
    assert (teams["b"]["target_share"], teams["b"]["share_if_busy"]) == (0.0, 0.5)


def test_a_socket_chooses_its_page(burst, member_setup, settings):
    """A member's page asks for its running jobs, then for a bad view: the next push lists only
    running jobs of its own team; the bad view is refused in the API's error shape."""
    settings.TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = 2
    client = Client()
    client.force_login(member_setup[0])

    async def scenario():
        communicator = socket(client.cookies["sessionid"].value)
        assert (await communicator.connect())[0]
        first = await receive_state(communicator)
        await communicator.send_json_to({"id": "v1", "view": {"tab": "running"}})
        ok = await receive_reply(communicator)
        chosen = await receive_state(communicator, where=lambda s: s["jobs_view"]["tab"] == "running")
        await communicator.send_json_to({"id": "v2", "view": {"tab": "running", "size": 0}})
        refused = await receive_reply(communicator)
        await communicator.send_json_to({"id": "v3", "view": "running"})
        not_an_object = await receive_reply(communicator)
        await communicator.disconnect()
        return first, ok, chosen, refused, not_an_object

    first, ok, chosen, refused, not_an_object = run(scenario)
    assert first["jobs_view"]["tab"] == "all" and len(first["jobs"]) == 13
    assert ok == {"reply": "v1", "ok": True}
    assert {(j["status"], j["team"]) for j in chosen["jobs"]} == {("running", "a")}
    assert refused["ok"] is False and refused["error"]["error"] == "validation_error"
    assert "size" in refused["error"]["fields"]
    assert not_an_object["error"]["fields"] == {"view": ["An object."]}
    assert "secret" not in json.dumps(chosen)
