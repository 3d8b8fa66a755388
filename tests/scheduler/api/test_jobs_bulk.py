"""POST /api/jobs/bulk/: up to 1,000 jobs, all or nothing, errors naming the failing job."""

import json

import pytest

from quotas.models import QuotaPolicy
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.services.submit import MAX_BULK
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def bulk(client, jobs):
    return client.post("/api/jobs/bulk/", {"jobs": jobs}, format="json")


def test_all_are_queued_and_returned_in_order(api, member_setup):
    alice = member_setup[0]
    response = bulk(api(alice), [chat_body("a", priority=i) for i in range(5)])
    assert response.status_code == 201, response.json()
    jobs = response.json()["jobs"]
    assert [job["priority"] for job in jobs] == [0, 1, 2, 3, 4]
    assert {job["status"] for job in jobs} == {"queued"} and {job["user"] for job in jobs} == {"alice"}
    assert sorted(Job.objects.values_list("pk", flat=True)) == [job["id"] for job in jobs]
    assert JobEvent.objects.filter(event="queued").count() == 5


def test_an_invalid_job_names_its_index_and_nothing_is_written(api, member_setup):
    alice = member_setup[0]
    broken = chat_body("a")
    broken["requirements"] = {"est_tokens": -1}
    response = bulk(api(alice), [chat_body("a"), chat_body("a"), broken])
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "validation_error" and body["index"] == 2
    assert set(body["fields"]["requirements"]) == {"model", "est_tokens"}
    assert not Job.objects.exists()


@pytest.mark.parametrize("item", [None, 7, "chat", []])
def test_a_job_that_is_not_an_object_names_its_index(api, member_setup, item):
    # The error keeps its shape (`fields` an object) whatever the item is.
    response = bulk(api(member_setup[0]), [chat_body("a"), item])
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "validation_error" and body["index"] == 1
    assert isinstance(body["fields"], dict) and body["fields"]["non_field_errors"]
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("make", "status", "code"),
    [
        (lambda: chat_body("a", model="nope"), 400, "unknown_model"),
        (lambda: chat_body("b"), 400, "validation_error"),
        (lambda: chat_body("a", type="flow"), 403, "forbidden"),
    ],
)
def test_a_refused_job_names_its_index(api, member_setup, make_team, make, status, code):
    alice = member_setup[0]
    make_team("c", {alice: "member"}, grants=("chat:use",))
    jobs = [chat_body("a"), chat_body("c"), make()]
    if code == "forbidden":
        jobs[2]["team"] = "c"
    response = bulk(api(alice), jobs)
    assert response.status_code == status, response.json()
    assert response.json()["error"] == code and response.json()["index"] == 2
    assert not Job.objects.exists()


def test_the_depth_cap_counts_the_batch(api, member_setup):
    alice = member_setup[0]
    QueuePolicy.objects.update_or_create(pk=1, defaults={"max_queue_depth": {"a": 3}})
    response = bulk(api(alice), [chat_body("a") for _ in range(4)])
    assert response.status_code == 429
    assert response.json()["error"] == "try_later" and response.json()["index"] == 3
    assert int(response.headers["Retry-After"]) >= 1
    assert not Job.objects.exists()


def test_a_budget_refusal(api, member_setup):
    alice = member_setup[0]
    QuotaPolicy.objects.create(scope="team", subject="a", dimension="ai.tokens", limit=150, window="day")
    response = bulk(api(alice), [chat_body("a"), chat_body("a", requirements={"model": "m", "est_tokens": 500})])
    assert response.status_code == 429
    assert response.json()["error"] == "quota_exceeded" and response.json()["index"] == 1


@pytest.mark.parametrize("jobs", [[], [chat_body("a")] * (MAX_BULK + 1), "not a list", None])
def test_the_body_itself(api, member_setup, jobs):
    response = bulk(api(member_setup[0]), jobs)
    assert response.status_code == 400
    assert response.json()["error"] == "validation_error" and "jobs" in response.json()["fields"]
    assert "index" not in response.json()


def test_unknown_body_fields_are_refused(api, member_setup):
    response = api(member_setup[0]).post("/api/jobs/bulk/", {"jobs": [chat_body("a")], "x": 1}, format="json")
    assert response.status_code == 400 and "x" in response.json()["fields"]


def test_a_thousand(api, member_setup):
    response = bulk(api(member_setup[0]), [chat_body("a") for _ in range(MAX_BULK)])
    assert response.status_code == 201
    assert len(response.json()["jobs"]) == MAX_BULK == Job.objects.count()


def test_unauthenticated(api, member_setup):
    assert bulk(api(), [chat_body("a")]).status_code == 401


def test_it_is_in_the_openapi_schema(api, operator):
    schema = api(operator).get("/api/schema/", {"format": "json"}).json()
    post = schema["paths"]["/api/jobs/bulk/"]["post"]
    assert "201" in post["responses"]
    assert "JobBulkSubmitInput" in str(post["requestBody"])


def test_a_tool_job_without_requirements_is_accepted_as_by_single_submit(api, member_setup):
    tool = {"type": "tool", "team": "a", "input": {"tool": "echo", "arguments": {"say": "hi"}}}
    client = api(member_setup[0])
    assert client.post("/api/jobs/", tool, format="json").status_code == 201
    response = bulk(client, [chat_body("a"), tool, tool])
    assert response.status_code == 201, response.json()
    assert [job["type"] for job in response.json()["jobs"]] == ["chat", "tool", "tool"]


def test_other_jobs_still_need_requirements(api, member_setup):
    body = chat_body("a")
    del body["requirements"]
    response = bulk(api(member_setup[0]), [chat_body("a"), body])
    assert response.status_code == 400 and response.json()["index"] == 1
    assert response.json()["fields"] == {"requirements": ["This field is required."]}


@pytest.mark.parametrize("text", ["a\\u0000b", "\\ud800"])
def test_unstorable_text_names_the_job_and_where_in_it(api, member_setup, text):
    jobs = [json.dumps(chat_body("a")) for _ in range(5)]
    jobs[3] = jobs[3].replace('"content": "hello"', f'"content": "{text}"')
    raw = '{"jobs": [' + ", ".join(jobs) + "]}"
    response = api(member_setup[0]).post("/api/jobs/bulk/", raw, content_type="application/json")
    assert response.status_code == 400
    body = response.json()
    assert body["error"] == "validation_error" and body["index"] == 3 and body["detail"] == "Job 3 is invalid."
    assert list(body["fields"]) == ["jobs[3].input.messages[0].content"]
    assert not Job.objects.exists()
