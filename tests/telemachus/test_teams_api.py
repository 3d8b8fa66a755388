import pytest

from scheduler.services.submit import job_submit
from telemachus.models import Membership, Team

pytestmark = pytest.mark.django_db


class TestTeamsApi:
    def test_operator_creates_team_with_members(self, api, operator, make_user):
        alice = make_user("alice")
        response = api(operator).post(
            "/api/teams/", {"slug": "ml", "name": "ML", "members": [{"username": "alice", "role": "manager"}]},
            format="json",
        )
        assert response.status_code == 201, response.json()
        assert response.json()["members"] == [{"username": "alice", "role": "manager"}]
        team = Team.objects.get(slug="ml")
        assert team.group.name == "team:ml"
        assert alice.groups.filter(pk=team.group.pk).exists(), "membership is mirrored in the team's group"

    def test_member_cannot_create_teams(self, api, member_setup):
        response = api(member_setup[0]).post("/api/teams/", {"slug": "x", "name": "X"}, format="json")
        assert response.status_code == 403
        assert response.json()["error"] == "forbidden"
        assert response.json()["permission"] == "scheduler.manage"
        assert not Team.objects.filter(slug="x").exists()

    def test_duplicate_slug(self, api, operator, member_setup):
        response = api(operator).post("/api/teams/", {"slug": "a", "name": "again"}, format="json")
        assert response.status_code == 400
        assert "slug" in response.json()["fields"]

    def test_unknown_member_leaves_no_team_behind(self, api, operator):
        response = api(operator).post(
            "/api/teams/", {"slug": "ghost", "name": "G", "members": [{"username": "nobody"}]}, format="json"
        )
        assert response.status_code == 400
        assert response.json()["fields"] == {"username": ["No user 'nobody'."]}
        assert not Team.objects.filter(slug="ghost").exists()

    def test_member_sees_only_own_teams(self, api, member_setup):
        listed = api(member_setup[0]).get("/api/teams/").json()["results"]
        assert [t["slug"] for t in listed] == ["a"]
        assert api(member_setup[0]).get("/api/teams/b/").status_code == 404
        assert api(member_setup[0]).get("/api/teams/a/").json()["members"] == [{"username": "alice", "role": "member"}]

    def test_other_teams_are_404_even_for_writes(self, api, member_setup):
        client = api(member_setup[0])
        assert client.patch("/api/teams/b/", {"name": "x"}, format="json").status_code == 404
        assert client.delete("/api/teams/b/").status_code == 404
        assert client.post("/api/teams/b/members/", {"username": "alice"}, format="json").status_code == 404

    def test_member_cannot_edit_own_team(self, api, member_setup):
        client = api(member_setup[0])
        assert client.patch("/api/teams/a/", {"name": "x"}, format="json").status_code == 403
        assert client.post("/api/teams/a/members/", {"username": "bob"}, format="json").status_code == 403

    def test_rename(self, api, operator, member_setup):
        response = api(operator).patch("/api/teams/a/", {"name": "Alpha"}, format="json")
        assert response.status_code == 200 and response.json()["name"] == "Alpha"
        assert api(operator).patch("/api/teams/a/", {"slug": "z"}, format="json").status_code == 400

    def test_add_change_and_remove_member(self, api, operator, member_setup):
        bob = member_setup[1]
        team = Team.objects.get(slug="a")
        client = api(operator)
        response = client.post("/api/teams/a/members/", {"username": "bob", "role": "member"}, format="json")
        assert response.status_code == 201
        assert response.json() == {"username": "bob", "role": "member"}
        client.post("/api/teams/a/members/", {"username": "bob", "role": "manager"}, format="json")
        assert Membership.objects.get(team=team, user=bob).role == "manager"
        assert bob.groups.filter(pk=team.group_id).exists()
        assert client.delete("/api/teams/a/members/bob/").status_code == 204
        assert not Membership.objects.filter(team=team, user=bob).exists()
        assert not bob.groups.filter(pk=team.group_id).exists()
        assert client.delete("/api/teams/a/members/bob/").status_code == 404

    def test_bad_role(self, api, operator, member_setup):
        response = api(operator).post("/api/teams/a/members/", {"username": "bob", "role": "owner"}, format="json")
        assert response.status_code == 400 and "role" in response.json()["fields"]

    def test_delete_empty_team(self, api, operator, make_team):
        team = make_team("temp")
        assert api(operator).delete("/api/teams/temp/").status_code == 204
        assert not Team.objects.filter(pk=team.pk).exists()

    def test_team_with_jobs_cannot_be_deleted(self, api, operator, member_setup):
        job_submit(user=member_setup[0], team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
        response = api(operator).delete("/api/teams/a/")
        assert response.status_code == 409 and response.json()["error"] == "conflict"
        assert Team.objects.filter(slug="a").exists()
