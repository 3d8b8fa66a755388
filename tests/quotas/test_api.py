import pytest

from quotas.models import QuotaPolicy

pytestmark = pytest.mark.django_db


class TestQuotaPoliciesApi:
    def test_create_each_scope(self, api, operator, member_setup):
        client = api(operator)
        bodies = [
            {"scope": "global", "dimension": "ai.concurrency", "limit": 10},
            {"scope": "executor", "subject": "shared", "dimension": "ai.concurrency", "limit": 3},
            {"scope": "team", "subject": "a", "dimension": "ai.tokens", "limit": 10_000, "window": "day"},
            {"scope": "user", "subject": "alice", "dimension": "ai.requests", "limit": 60, "window": "minute"},
        ]
        for body in bodies:
            response = client.post("/api/quota-policies/", body, format="json")
            assert response.status_code == 201, response.json()
            shown = response.json()
            assert shown["subject"] == body.get("subject") and shown["window"] == body.get("window")
        assert len(client.get("/api/quota-policies/").json()["results"]) == 4

    @pytest.mark.parametrize(
        ("body", "field"),
        [
            ({"scope": "galaxy", "dimension": "ai.concurrency", "limit": 1}, "scope"),
            ({"scope": "global", "dimension": "ai.vibes", "limit": 1}, "dimension"),
            ({"scope": "global", "dimension": "ai.concurrency", "limit": -1}, "limit"),
            ({"scope": "global", "dimension": "ai.concurrency", "limit": 1, "window": "day"}, "window"),
            ({"scope": "global", "dimension": "ai.tokens", "limit": 1}, "window"),
            ({"scope": "global", "dimension": "ai.tokens", "limit": 1, "window": "week"}, "window"),
            ({"scope": "global", "subject": "a", "dimension": "ai.concurrency", "limit": 1}, "subject"),
            ({"scope": "team", "dimension": "ai.concurrency", "limit": 1}, "subject"),
            ({"scope": "team", "subject": "nope", "dimension": "ai.concurrency", "limit": 1}, "subject"),
            ({"scope": "user", "subject": "nobody", "dimension": "ai.concurrency", "limit": 1}, "subject"),
            ({"scope": "executor", "subject": "nope", "dimension": "ai.concurrency", "limit": 1}, "subject"),
        ],
    )
    def test_bad_input(self, api, operator, member_setup, body, field):
        response = api(operator).post("/api/quota-policies/", body, format="json")
        assert response.status_code == 400
        assert response.json()["error"] == "validation_error"
        assert field in response.json()["fields"]
        assert not QuotaPolicy.objects.exists()

    def test_duplicate_rule(self, api, operator):
        body = {"scope": "global", "dimension": "ai.concurrency", "limit": 5}
        api(operator).post("/api/quota-policies/", body, format="json")
        response = api(operator).post("/api/quota-policies/", body, format="json")
        assert response.status_code == 400 and "non_field_errors" in response.json()["fields"]

    def test_update_and_delete(self, api, operator):
        client = api(operator)
        created = client.post(
            "/api/quota-policies/", {"scope": "global", "dimension": "ai.concurrency", "limit": 5}, format="json"
        ).json()
        response = client.patch(f"/api/quota-policies/{created['id']}/", {"limit": 7}, format="json")
        assert response.status_code == 200 and response.json()["limit"] == 7
        bad = client.patch(f"/api/quota-policies/{created['id']}/", {"window": "hour"}, format="json")
        assert bad.status_code == 400
        assert client.delete(f"/api/quota-policies/{created['id']}/").status_code == 204
        assert client.get(f"/api/quota-policies/{created['id']}/").status_code == 404

    def test_members_are_forbidden(self, api, member_setup):
        client = api(member_setup[0])
        assert client.get("/api/quota-policies/").status_code == 403
        body = {"scope": "global", "dimension": "ai.concurrency", "limit": 5}
        assert client.post("/api/quota-policies/", body, format="json").status_code == 403
