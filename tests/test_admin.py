import pytest
from django.utils import timezone

from quotas.budget import Bill, quota_settle
from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent
from scheduler.services.cancel import job_cancel
from scheduler.services.claim import job_claim
from scheduler.services.rounds import round_finish
from scheduler.services.submit import job_submit

pytestmark = pytest.mark.django_db

PAGES = [
    "/admin/",
    "/admin/telemachus/team/",
    "/admin/telemachus/membership/",
    "/admin/executors/executor/",
    "/admin/quotas/quotapolicy/",
    "/admin/quotas/usage/",
    "/admin/scheduler/job/",
    "/admin/scheduler/jobevent/",
    "/admin/scheduler/slot/",
    "/admin/scheduler/queuepolicy/",
]


@pytest.fixture
def admin_client_with_data(client, operator, member_setup):
    job_submit(user=member_setup[0], team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    client.force_login(operator)
    return client


@pytest.mark.parametrize("page", PAGES)
def test_changelists_render(admin_client_with_data, page):
    response = admin_client_with_data.get(page)
    assert response.status_code == 200


def test_job_detail_renders_events(admin_client_with_data):
    job = Job.objects.get()
    response = admin_client_with_data.get(f"/admin/scheduler/job/{job.pk}/change/")
    assert response.status_code == 200
    assert b"queued" in response.content


def test_cancel_action_uses_the_service(admin_client_with_data):
    job = Job.objects.get()
    response = admin_client_with_data.post(
        "/admin/scheduler/job/", {"action": "cancel", "_selected_action": [job.pk]}, follow=True
    )
    assert response.status_code == 200
    job.refresh_from_db()
    assert job.status == "canceled"
    assert list(job.events.values_list("event", flat=True)) == ["queued", "canceled"]


def test_job_events_are_read_only(admin_client_with_data):
    response = admin_client_with_data.get("/admin/scheduler/jobevent/add/")
    assert response.status_code == 403


def test_team_created_in_admin_gets_a_group(admin_client_with_data, make_user):
    carol = make_user("carol")
    response = admin_client_with_data.post(
        "/admin/telemachus/team/add/",
        {
            "slug": "ops",
            "name": "Ops",
            "memberships-TOTAL_FORMS": "1",
            "memberships-INITIAL_FORMS": "0",
            "memberships-0-user": carol.pk,
            "memberships-0-role": "manager",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    from telemachus.models import Team

    team = Team.objects.get(slug="ops")
    assert team.group.name == "team:ops"
    assert carol.groups.filter(pk=team.group_id).exists()
    assert team.memberships.get().role == "manager"


def test_budget_rules_show_their_usage(admin_client_with_data, member_setup):
    alice, _, team_a, _, _ = member_setup
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=1000, window="day")
    quota_settle(
        reservations=[],
        bills=[Bill(team_id=team_a.pk, user_id=alice.pk, executor_id=None, tokens=300)],
        now=timezone.now(),
    )
    page = admin_client_with_data.get("/admin/quotas/quotapolicy/").content.decode()
    assert "300 (+0)" in page and ">700<" in page and " UTC" in page


def test_requeue_action_uses_the_service(admin_client_with_data):
    job = Job.objects.get()
    job_cancel(job_id=job.pk)
    response = admin_client_with_data.post(
        "/admin/scheduler/job/", {"action": "requeue", "_selected_action": [job.pk]}, follow=True
    )
    assert b"Requeued 1 job(s)." in response.content
    job.refresh_from_db()
    assert job.status == "queued" and job.events.last().meta["was"] == "canceled"


def test_a_running_flow_shows_its_round(admin_client_with_data, member_setup):
    Job.objects.all().delete()
    flow = job_submit(
        user=member_setup[0],
        team="a",
        type="flow",
        requirements={"model": "m"},
        input={"messages": [{"role": "user", "content": "go"}], "tools": ["echo"]},
    )
    (claim,) = job_claim(worker="w", limit=1).claims  # the claim starts round 1 (round_started)
    page = admin_client_with_data.get("/admin/scheduler/job/").content.decode()
    assert "round 1" in page
    round_finish(job_id=flow.pk, lease=claim.lease, round=1, message={"role": "assistant", "content": "ok"})
    page = admin_client_with_data.get(f"/admin/scheduler/job/{flow.pk}/change/").content.decode()
    assert "round_started" in page and "round_finished" in page
    assert "1 round" in admin_client_with_data.get("/admin/scheduler/job/").content.decode()


class TestStaffReadTheJobsTheApiShowsThem:
    """A staff user with the model permission `view_job` (the admin's door) reads in the admin
    only the jobs the API shows them, with their prompts and answers; other teams' stay hidden."""

    @pytest.fixture
    def jobs(self, member_setup, make_user, api):
        from django.contrib.auth.models import Permission

        from telemachus.teams.services import team_member_set

        alice, bob, *_ = member_setup
        sam = make_user("sam", is_staff=True)
        sam.user_permissions.add(
            *Permission.objects.filter(codename__in=["view_job", "view_jobevent", "view_slot", "change_job"])
        )
        team_member_set(team=member_setup[2], username="sam", role="member")

        def submit(user, team, prompt):
            job = job_submit(
                user=user,
                team=team,
                type="chat",
                requirements={"model": "m"},
                input={"messages": [{"role": "user", "content": prompt}]},
            )
            Job.objects.filter(pk=job.pk).update(result={"message": {"content": f"answer to {prompt}"}})
            return job.pk

        return {
            "sam": sam,
            "own": submit(sam, "a", "sams-own-prompt"),
            "teammate": submit(alice, "a", "alices-prompt"),
            "other_team": submit(bob, "b", "bobs-prompt"),
        }

    def api_ids(self, api, user) -> set[int]:
        return {job["id"] for job in api(user).get("/api/jobs/").json()["results"]}

    def test_lists_details_and_events_follow_the_api(self, client, api, jobs):
        sam = jobs["sam"]
        client.force_login(sam)
        assert self.api_ids(api, sam) == {jobs["own"]}

        listing = client.get("/admin/scheduler/job/").content.decode()
        assert f"/admin/scheduler/job/{jobs['own']}/change/" in listing
        for hidden in ("teammate", "other_team"):
            assert f"/admin/scheduler/job/{jobs[hidden]}/change/" not in listing
        team_b = Job.objects.get(pk=jobs["other_team"]).team_id
        assert f"team__id__exact={team_b}" not in listing  # the filters name no team the user cannot see

        own = client.get(f"/admin/scheduler/job/{jobs['own']}/change/")
        assert own.status_code == 200 and "sams-own-prompt" in own.content.decode()
        assert "answer to sams-own-prompt" in own.content.decode()
        for hidden, prompt in (("teammate", "alices-prompt"), ("other_team", "bobs-prompt")):
            detail = client.get(f"/admin/scheduler/job/{jobs[hidden]}/change/", follow=True)
            assert prompt not in detail.content.decode() and f"answer to {prompt}" not in detail.content.decode()
            assert detail.redirect_chain and detail.redirect_chain[-1][0] == "/admin/"  # "not found", as a missing one

        events = client.get("/admin/scheduler/jobevent/").content.decode()
        assert "bobs-prompt" not in events
        shown = {int(n) for n in JobEvent.objects.filter(pk__in=self.event_ids(events)).values_list("job", flat=True)}
        assert shown == {jobs["own"]}

    @staticmethod
    def event_ids(page: str) -> list[int]:
        import re

        return [int(n) for n in re.findall(r"/admin/scheduler/jobevent/(\d+)/change/", page)]

    def test_a_manager_and_a_shared_job_are_shown_as_the_api_shows_them(self, client, api, jobs):
        from guardian.shortcuts import assign_perm

        from telemachus.models import Team
        from telemachus.teams.services import team_member_set

        sam = jobs["sam"]
        team_member_set(team=Team.objects.get(slug="a"), username="sam", role="manager")
        assign_perm("scheduler.view_job", sam, Job.objects.get(pk=jobs["other_team"]))
        client.force_login(sam)
        assert self.api_ids(api, sam) == {jobs["own"], jobs["teammate"], jobs["other_team"]}
        for name, prompt in (("teammate", "alices-prompt"), ("other_team", "bobs-prompt")):
            detail = client.get(f"/admin/scheduler/job/{jobs[name]}/change/")
            assert detail.status_code == 200 and prompt in detail.content.decode()

    def test_cancel_follows_the_api(self, client, jobs):
        """Seeing a job is not cancelling it: the action cancels what the API would let the user
        cancel (owner, team manager, operator), and nothing the user cannot see."""
        from guardian.shortcuts import assign_perm

        sam = jobs["sam"]
        assign_perm("scheduler.view_job", sam, Job.objects.get(pk=jobs["other_team"]))  # shown, not theirs
        client.force_login(sam)
        selected = [jobs["own"], jobs["teammate"], jobs["other_team"]]
        response = client.post("/admin/scheduler/job/", {"action": "cancel", "_selected_action": selected}, follow=True)
        assert "Canceled 1 job(s)." in response.content.decode()
        statuses = dict(Job.objects.filter(pk__in=selected).values_list("pk", "status"))
        assert statuses == {jobs["own"]: "canceled", jobs["teammate"]: "queued", jobs["other_team"]: "queued"}
