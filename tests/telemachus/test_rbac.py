"""RBAC: job-type permissions granted through guardian, roles, visibility, no mass assignment."""

import pytest
from django.contrib.auth.models import Permission
from guardian.shortcuts import assign_perm

from scheduler.models import Job, JobEvent
from scheduler.services.submit import job_submit
from tests.conftest import chat_body, job_body

pytestmark = pytest.mark.django_db


@pytest.fixture
def chat_only(make_user, make_team, make_executor):
    """Team `lab` granting only chat:use; carol is a member, mia its manager."""
    carol, mia = make_user("carol"), make_user("mia")
    team = make_team("lab", {carol: "member", mia: "manager"}, grants=("chat:use",))
    make_executor("shared", models=["m"])
    return team, carol, mia


def submit(client, type="chat", **overrides):
    return client.post("/api/jobs/", job_body("lab", type, **overrides), format="json")


class TestJobTypePermissions:
    @pytest.mark.parametrize(
        ("job_type", "permission"), [("flow", "flows:run"), ("task", "flows:run"), ("tool", "tools:invoke")]
    )
    def test_missing_permission_is_403_naming_it_and_persists_nothing(self, api, chat_only, job_type, permission):
        _, carol, _ = chat_only
        response = submit(api(carol), type=job_type)
        assert response.status_code == 403
        assert response.json() == {
            "error": "forbidden",
            "detail": f"Requires {permission} in team 'lab'.",
            "permission": permission,
            "team": "lab",
        }
        assert not Job.objects.exists() and not JobEvent.objects.exists()

    @pytest.mark.parametrize("job_type", ["chat", "translate"])
    def test_team_grant_allows_chat(self, api, chat_only, job_type):
        assert submit(api(chat_only[1]), type=job_type).status_code == 201

    def test_grant_to_one_user_on_the_team(self, api, chat_only):
        team, carol, mia = chat_only
        assign_perm("telemachus.run_flows", carol, team)
        assert submit(api(carol), type="flow").status_code == 201
        assert submit(api(mia), type="flow").status_code == 403

    def test_global_grant(self, api, chat_only):
        _, carol, _ = chat_only
        carol.user_permissions.add(Permission.objects.get(codename="invoke_tools"))
        assert submit(api(carol), type="tool").status_code == 201

    def test_grant_on_another_team_does_not_count(self, api, chat_only, make_team):
        _, carol, _ = chat_only
        other = make_team("other", {carol: "member"}, grants=())
        assign_perm("telemachus.run_flows", other.group, other)
        assert submit(api(carol), type="flow").status_code == 403

    def test_revoking_the_team_grant(self, api, operator, chat_only):
        _, carol, _ = chat_only
        response = api(operator).put("/api/teams/lab/grants/", {"team": []}, format="json")
        assert response.status_code == 200 and response.json() == {"team": [], "users": {}}
        assert submit(api(carol)).status_code == 403

    def test_operator_needs_no_grant(self, api, operator, chat_only):
        assert submit(api(operator), type="flow").status_code == 201


class TestGrantsApi:
    def test_operator_sets_team_and_user_grants(self, api, operator, chat_only):
        body = {"team": ["chat:use", "tools:invoke"], "users": {"carol": ["flows:run"]}}
        response = api(operator).put("/api/teams/lab/grants/", body, format="json")
        assert response.status_code == 200
        assert response.json() == {"team": ["chat:use", "tools:invoke"], "users": {"carol": ["flows:run"]}}
        assert api(operator).get("/api/teams/lab/").json()["grants"] == response.json()

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"team": ["root:all"]}, "team"),
            ({"team": [], "users": {"nobody": ["chat:use"]}}, "users"),
            ({"users": {}}, "team"),
        ],
    )
    def test_bad_grants(self, api, operator, chat_only, body, field):
        response = api(operator).put("/api/teams/lab/grants/", body, format="json")
        assert response.status_code == 400 and field in response.json()["fields"]

    def test_managers_cannot_grant(self, api, chat_only):
        response = api(chat_only[2]).put("/api/teams/lab/grants/", {"team": ["flows:run"]}, format="json")
        assert response.status_code == 403 and response.json()["permission"] == "scheduler.manage"


class TestRoles:
    @pytest.fixture
    def jobs(self, chat_only, make_user):
        team, carol, mia = chat_only
        dave = make_user("dave")
        from telemachus.teams.services import team_member_set

        team_member_set(team=team, username="dave", role="member")
        mine = job_submit(user=carol, team="lab", type="chat", requirements={"model": "m"}, input={"messages": []})
        theirs = job_submit(user=dave, team="lab", type="chat", requirements={"model": "m"}, input={"messages": []})
        return mine, theirs, dave

    def test_member_sees_only_own_jobs(self, api, chat_only, jobs):
        mine, theirs, _ = jobs
        client = api(chat_only[1])
        assert [j["id"] for j in client.get("/api/jobs/").json()["results"]] == [mine.pk]
        assert client.get(f"/api/jobs/{theirs.pk}/").status_code == 404
        assert client.post(f"/api/jobs/{theirs.pk}/cancel/").status_code == 404

    def test_member_cancels_own_job(self, api, chat_only, jobs):
        assert api(chat_only[1]).post(f"/api/jobs/{jobs[0].pk}/cancel/").status_code == 200

    def test_manager_sees_and_cancels_every_team_job(self, api, chat_only, jobs):
        client = api(chat_only[2])
        assert {j["id"] for j in client.get("/api/jobs/").json()["results"]} == {jobs[0].pk, jobs[1].pk}
        assert client.post(f"/api/jobs/{jobs[1].pk}/cancel/").status_code == 200

    def test_shared_job_is_visible_but_not_cancellable(self, api, chat_only, jobs):
        _, carol, _ = chat_only
        assign_perm("scheduler.view_job", carol, jobs[1])
        client = api(carol)
        assert client.get(f"/api/jobs/{jobs[1].pk}/").status_code == 200
        response = client.post(f"/api/jobs/{jobs[1].pk}/cancel/")
        assert response.status_code == 403 and response.json()["permission"] == "job:cancel"
        assert Job.objects.get(pk=jobs[1].pk).status == "queued"

    def test_manager_manages_members(self, api, chat_only, make_user, make_team):
        # Given erin, who shares another team with mia, lab's manager...
        make_team("other", {make_user("erin"): "member", chat_only[2]: "member"})
        client = api(chat_only[2])
        assert client.post("/api/teams/lab/members/", {"username": "erin"}, format="json").status_code == 201
        assert client.delete("/api/teams/lab/members/erin/").status_code == 204

    def test_member_cannot_manage_members(self, api, chat_only, make_user):
        make_user("erin")
        response = api(chat_only[1]).post("/api/teams/lab/members/", {"username": "erin"}, format="json")
        assert response.status_code == 403 and response.json()["permission"] == "team:manage"


class TestCrossTeamIsolation:
    """A member of team a gets 404 on every job endpoint for a job of team b."""

    @pytest.fixture
    def bobs_job(self, member_setup):
        return job_submit(
            user=member_setup[1], team="b", type="chat", requirements={"model": "m"}, input={"messages": []}
        )

    def test_detail(self, api, member_setup, bobs_job):
        assert api(member_setup[0]).get(f"/api/jobs/{bobs_job.pk}/").json()["error"] == "not_found"

    def test_cancel(self, api, member_setup, bobs_job):
        assert api(member_setup[0]).post(f"/api/jobs/{bobs_job.pk}/cancel/").status_code == 404
        assert Job.objects.get(pk=bobs_job.pk).status == "queued"

    def test_events(self, api, member_setup, bobs_job):
        assert api(member_setup[0]).get(f"/api/jobs/{bobs_job.pk}/events/").status_code == 404

    @pytest.mark.parametrize("query", ["", "?team=b", "?status=queued", "?type=chat"])
    def test_lists(self, api, member_setup, bobs_job, query):
        assert api(member_setup[0]).get(f"/api/jobs/{query}").json()["results"] == []


class TestNoMassAssignment:
    @pytest.mark.parametrize(
        "field, value",
        [
            ("status", "done"),
            ("executor", "shared"),
            ("tokens_used", 1),
            ("attempts", 9),
            ("user", "bob"),
            ("result", {"text": "forged"}),
            ("lease", "x"),
        ],
    )
    def test_submit_refuses_server_fields(self, api, member_setup, field, value):
        response = api(member_setup[0]).post("/api/jobs/", chat_body("a", **{field: value}), format="json")
        assert response.status_code == 400 and field in response.json()["fields"]
        assert not Job.objects.exists()

    def test_submit_into_a_team_one_is_not_in(self, api, member_setup):
        response = api(member_setup[0]).post("/api/jobs/", chat_body("b"), format="json")
        assert response.status_code == 400 and "team" in response.json()["fields"]
        assert not Job.objects.exists()

    @pytest.mark.parametrize("method", ["put", "patch", "delete"])
    def test_jobs_cannot_be_updated(self, api, member_setup, method):
        job = job_submit(
            user=member_setup[0], team="a", type="chat", requirements={"model": "m"}, input={"messages": []}
        )
        response = getattr(api(member_setup[0]), method)(f"/api/jobs/{job.pk}/", {"status": "done"}, format="json")
        assert response.status_code == 405 and response.json()["error"] == "method_not_allowed"
        assert Job.objects.get(pk=job.pk).status == "queued"

    def test_team_update_takes_only_the_name(self, api, operator, member_setup):
        response = api(operator).patch("/api/teams/a/", {"name": "A", "members": []}, format="json")
        assert response.status_code == 400 and "members" in response.json()["fields"]
