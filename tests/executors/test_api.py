import pytest

from executors.models import Executor
from scheduler.models import Slot

pytestmark = pytest.mark.django_db

BODY = {
    "name": "gpu-1", "kind": "local-model", "endpoint": "http://127.0.0.1:9/v1",
    "capabilities": {"models": ["llama3"], "class": "gpu"}, "max_concurrency": 2,
}


class TestExecutorsApi:
    def test_operator_creates_and_reads(self, api, operator, make_team):
        team = make_team("ml")
        response = api(operator).post("/api/executors/", {**BODY, "team": "ml", "weight": 3}, format="json")
        assert response.status_code == 201, response.json()
        created = response.json()
        assert created["team"] == "ml" and created["health"] == "ok" and created["enabled"] is True
        assert Executor.objects.get(name="gpu-1").team == team
        assert api(operator).get(f"/api/executors/{created['id']}/").json() == created
        assert [e["name"] for e in api(operator).get("/api/executors/").json()["results"]] == ["gpu-1"]

    def test_members_are_forbidden(self, api, member_setup):
        client = api(member_setup[0])
        executor = member_setup[4]
        for response in (
            client.get("/api/executors/"),
            client.post("/api/executors/", BODY, format="json"),
            client.get(f"/api/executors/{executor.pk}/"),
            client.patch(f"/api/executors/{executor.pk}/", {"enabled": False}, format="json"),
            client.delete(f"/api/executors/{executor.pk}/"),
        ):
            assert response.status_code == 403
            assert response.json()["error"] == "forbidden"
        assert Executor.objects.filter(pk=executor.pk, enabled=True).exists()

    @pytest.mark.parametrize(
        ("change", "field"),
        [
            ({"kind": "quantum"}, "kind"),
            ({"endpoint": None}, "endpoint"),
            ({"endpoint": "ftp://127.0.0.1/"}, "endpoint"),
            ({"max_concurrency": -1}, "max_concurrency"),
            ({"capabilities": {"models": "llama3"}}, "capabilities"),
            ({"capabilities": {"models": ["x"], "class": "tpu"}}, "capabilities"),
            ({"team": "nope"}, "team"),
            ({"health": "down"}, "health"),
            ({"name": "has space"}, "name"),
        ],
    )
    def test_bad_input(self, api, operator, change, field):
        response = api(operator).post("/api/executors/", {**BODY, **change}, format="json")
        assert response.status_code == 400
        assert field in response.json()["fields"]
        assert not Executor.objects.exists()

    def test_duplicate_name(self, api, operator, make_executor):
        make_executor("gpu-1")
        response = api(operator).post("/api/executors/", BODY, format="json")
        assert response.status_code == 400 and "name" in response.json()["fields"]

    def test_patch_enabled_and_capacity(self, api, operator, make_executor):
        executor = make_executor("e1")
        response = api(operator).patch(
            f"/api/executors/{executor.pk}/", {"enabled": False, "max_concurrency": 9}, format="json"
        )
        assert response.status_code == 200
        executor.refresh_from_db()
        assert executor.enabled is False and executor.max_concurrency == 9

    def test_missing_is_404(self, api, operator):
        assert api(operator).get("/api/executors/999/").status_code == 404

    def test_delete_idle_executor(self, api, operator, make_executor):
        executor = make_executor("e1")
        assert api(operator).delete(f"/api/executors/{executor.pk}/").status_code == 204
        assert not Executor.objects.filter(pk=executor.pk).exists()

    def test_delete_busy_executor_is_409(self, api, operator, member_setup):
        from scheduler.services.claim import job_claim
        from scheduler.services.submit import job_submit

        alice, _, _, _, executor = member_setup
        job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
        job_claim(worker="w", limit=1)
        assert Slot.objects.filter(executor=executor).exists()
        response = api(operator).delete(f"/api/executors/{executor.pk}/")
        assert response.status_code == 409 and response.json()["error"] == "conflict"
