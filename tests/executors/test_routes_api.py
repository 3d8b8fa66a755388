"""/api/routes/ (issue #39): operators edit model routes, audited like every configuration change;
anyone signed in reads them, since apps call their names."""

import pytest

from executors.models import ModelRoute
from scheduler.live.snapshot import queue_snapshot
from telemachus.models import AuditEvent
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def test_an_operator_creates_edits_and_deletes_a_route(api, operator):
    client = api(operator)
    created = client.post("/api/routes/", {"name": "smart", "models": ["a", "b"]}, format="json")
    assert created.status_code == 201, created.content
    route_id = created.json()["id"]
    assert created.json()["models"] == ["a", "b"]
    edited = client.patch(f"/api/routes/{route_id}/", {"models": ["b", "a"]}, format="json")
    assert edited.status_code == 200 and edited.json()["models"] == ["b", "a"]
    assert client.delete(f"/api/routes/{route_id}/").status_code == 204
    assert not ModelRoute.objects.exists()
    audited = list(
        AuditEvent.objects.filter(object_type="route").order_by("id").values_list("action", "before", "after")
    )
    assert audited == [
        ("route.create", None, {"name": "smart", "models": ["a", "b"]}),
        ("route.update", {"models": ["a", "b"]}, {"models": ["b", "a"]}),
        ("route.delete", {"name": "smart", "models": ["b", "a"]}, None),
    ]


def test_a_member_reads_but_does_not_edit(api, member_setup):
    alice = member_setup[0]
    ModelRoute.objects.create(name="smart", models=["m"])
    client = api(alice)
    assert [r["name"] for r in client.get("/api/routes/").json()["results"]] == ["smart"]
    refused = client.post("/api/routes/", {"name": "fast", "models": ["m"]}, format="json")
    assert refused.status_code == 403


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "smart", "models": []}, "models"),
        ({"name": "smart", "models": ["a", "a"]}, "models"),
        ({"name": "smart", "models": ["smart", "a"]}, "models"),
        ({"name": "taken", "models": ["a"]}, "name"),
        ({"name": "smart", "models": ["a"], "extra": 1}, "extra"),
    ],
)
def test_a_bad_route_is_refused(api, operator, body, field):
    ModelRoute.objects.create(name="taken", models=["m"])
    refused = api(operator).post("/api/routes/", body, format="json")
    assert refused.status_code == 400 and field in refused.json()["fields"], refused.content


def test_the_job_api_and_its_bulk_submit_call_a_route(api, member_setup, make_executor):
    alice, *_ = member_setup
    make_executor("eb", models=["b"])
    ModelRoute.objects.create(name="smart", models=["gone", "m", "b"])
    client = api(alice)
    body = chat_body("a", model="smart")
    body["requirements"]["max_queue_seconds"] = 2.5
    one = client.post("/api/jobs/", body, format="json")
    assert one.status_code == 201, one.content
    assert (one.json()["model"], one.json()["route"], one.json()["requirements"]["model"]) == ("m", "smart", "smart")
    bulk = client.post("/api/jobs/bulk/", {"jobs": [chat_body("a", model="smart")] * 3}, format="json")
    assert bulk.status_code == 201, bulk.content
    assert [job["model"] for job in bulk.json()["jobs"]] == ["m"] * 3
    events = client.get(f"/api/jobs/{one.json()['id']}/events/").json()["results"]
    assert [(e["event"], e["meta"].get("reason")) for e in events] == [("queued", None), ("fell_back", "not_offered")]


def test_a_bad_queue_deadline_is_refused(api, member_setup):
    body = chat_body("a")
    body["requirements"]["max_queue_seconds"] = -1
    refused = api(member_setup[0]).post("/api/jobs/", body, format="json")
    assert refused.status_code == 400 and "requirements" in refused.json()["fields"]


def test_the_dashboard_shows_the_routes(member_setup):
    ModelRoute.objects.create(name="smart", models=["a", "m"])
    assert queue_snapshot(user=member_setup[0])["routes"] == [{"name": "smart", "models": ["a", "m"]}]
