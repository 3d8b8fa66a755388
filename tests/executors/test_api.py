import pytest

from executors.models import Executor
from scheduler.models import Slot

pytestmark = pytest.mark.django_db

BODY = {
    "name": "gpu-1",
    "kind": "local-model",
    "endpoint": "http://127.0.0.1:9/v1",
    "capabilities": {"models": ["llama3"], "class": "gpu"},
    "max_concurrency": 2,
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


class TestSimKnobs:
    """A sim executor's meta is checked against the knobs' bounds (executors/simknobs.py): a 400
    names the knob, by the API on create and edit, and by the admin's form."""

    SIM = {"name": "sim-1", "kind": "sim", "capabilities": {"models": ["m"]}}

    @pytest.mark.parametrize(
        ("meta", "knob"),
        [
            ({"latency_ms": -5}, "latency_ms"),
            ({"latency_ms": "abc"}, "latency_ms"),
            ({"latency_ms": 1e12}, "latency_ms"),
            ({"fail_rate": 2}, "fail_rate"),
            ({"output_tokens": 2.5}, "output_tokens"),
            ({"tokens_per_s": True}, "tokens_per_s"),
            ({"embedding_dims": 0}, "embedding_dims"),
            ({"jitter_ms": None}, "jitter_ms"),
        ],
    )
    def test_nonsense_is_a_400_naming_the_knob(self, api, operator, meta, knob):
        response = api(operator).post("/api/executors/", {**self.SIM, "meta": meta}, format="json")
        assert response.status_code == 400
        assert list(response.json()["fields"]["meta"]) == [knob]
        assert "must be" in response.json()["fields"]["meta"][knob][0]
        assert not Executor.objects.exists()

    def test_edits_are_checked_and_good_values_pass(self, api, operator):
        client = api(operator)
        meta = {
            "latency_ms": 20,
            "jitter_ms": 5,
            "tokens_per_s": 40.5,
            "output_tokens": 8,
            "fail_rate": 0.1,
            "note": "x",
        }
        created = client.post("/api/executors/", {**self.SIM, "meta": meta}, format="json")
        assert created.status_code == 201, created.json()
        path = f"/api/executors/{created.json()['id']}/"
        response = client.patch(path, {"meta": {"latency_ms": float("1e12")}}, format="json")
        assert response.status_code == 400 and "latency_ms" in response.json()["fields"]["meta"]
        assert Executor.objects.get().meta == meta
        # Other kinds' meta is theirs to read: not checked against the sim's knobs.
        other = client.post("/api/executors/", {**BODY, "meta": {"latency_ms": -5}}, format="json")
        assert other.status_code == 201

    def test_the_admin_form_refuses_nonsense(self, operator, client):
        client.force_login(operator)
        response = client.post(
            "/admin/executors/executor/add/",
            {
                "name": "sim-2",
                "kind": "sim",
                "capabilities": '{"models": ["m"]}',
                "max_concurrency": 4,
                "weight": 1,
                "enabled": "on",
                "transport": "{}",
                "meta": '{"latency_ms": "abc"}',
            },
        )
        assert response.status_code == 200 and b"meta.latency_ms must be a number" in response.content
        assert not Executor.objects.exists()
