"""Request bodies: size, nesting and text PostgreSQL cannot store are refused with 4xx, whatever
endpoint they are sent to, before anything is written."""

import json

import pytest
from django.test import override_settings

from executors.models import Executor
from scheduler.models import Job
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def post_raw(client, path: str, raw: str | bytes, method: str = "post"):
    return getattr(client, method)(path, raw, content_type="application/json")


def test_a_thousand_nested_brackets_are_a_400(api, member_setup):
    response = post_raw(api(member_setup[0]), "/api/jobs/", "[" * 1000 + "]" * 1000)
    assert response.status_code == 400 and response.json()["error"] in {"parse_error", "validation_error"}


def test_nesting_past_the_limit_inside_a_valid_job_is_a_400(api, member_setup):
    body = chat_body("a", meta={"deep": json.loads("[" * 70 + "]" * 70)})
    response = api(member_setup[0]).post("/api/jobs/", body, format="json")
    assert response.status_code == 400 and response.json()["error"] == "validation_error"
    assert "Nested deeper" in json.dumps(response.json()["fields"])
    assert not Job.objects.exists()


BAD_TEXT = ["\\u0000", "a\\u0000b", "\\ud800", "x\\udfffy", "\\udc00\\ud800"]


@pytest.mark.parametrize("text", BAD_TEXT)
@pytest.mark.parametrize(
    "where",
    [
        '"meta": {"note": "%s"}',
        '"meta": {"%s": 1}',
        '"input": {"messages": [{"role": "user", "content": "%s"}]}',
        '"input": {"messages": [{"role": "user", "content": "hi"}], "extra": ["%s"]}',
    ],
)
def test_nul_or_a_lone_surrogate_in_free_form_json_is_a_400(api, member_setup, text, where):
    # Given a valid job body with the text spliced into a free-form part...
    body = json.dumps(chat_body("a"))[:-1] + ", " + (where % text) + "}"
    response = post_raw(api(member_setup[0]), "/api/jobs/", body)
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "validation_error"
    assert not Job.objects.exists()


def test_a_valid_surrogate_pair_is_fine(api, member_setup):
    body = json.dumps(chat_body("a"))[:-1] + ', "meta": {"emoji": "\\ud83d\\ude00"}}'
    response = post_raw(api(member_setup[0]), "/api/jobs/", body)
    assert response.status_code == 201, response.content
    assert Job.objects.get().meta == {"emoji": "\U0001f600"}


@pytest.mark.parametrize(
    "field,value",
    [
        ("meta", '{"a": "\\u0000"}'),
        ("transport", '{"\\ud800": 1}'),
        ("capabilities", '{"models": ["m"], "note": "\\u0000"}'),
    ],
)
def test_executor_free_form_fields_refuse_unstorable_text(api, operator, field, value):
    body = {"name": "e1", "kind": "sim", "capabilities": {"models": ["m"]}}
    raw = json.dumps({k: v for k, v in body.items() if k != field})[:-1] + f', "{field}": {value}}}'
    response = post_raw(api(operator), "/api/executors/", raw)
    assert response.status_code == 400 and response.json()["error"] == "validation_error"
    assert not Executor.objects.exists()


@pytest.mark.parametrize("body", ['{"team_weights": {"\\u0000": 1}}', '{"priority_map": {"user:\\ud800": 1}}'])
def test_policy_keys_refuse_unstorable_text(api, operator, body):
    response = post_raw(api(operator), "/api/policy/", body, method="put")
    assert response.status_code == 400 and response.json()["error"] == "validation_error"


def test_grants_refuse_unstorable_user_names(api, operator, make_team):
    make_team("a")
    response = post_raw(
        api(operator), "/api/teams/a/grants/", '{"team": [], "users": {"\\u0000": ["chat:use"]}}', method="put"
    )
    assert response.status_code == 400 and response.json()["error"] == "validation_error"


@override_settings(TELEMACHUS_MAX_BODY_BYTES=1000)
def test_a_body_over_the_limit_is_a_413(api, member_setup):
    body = chat_body("a", meta={"pad": "x" * 2000})
    response = api(member_setup[0]).post("/api/jobs/", body, format="json")
    assert response.status_code == 413
    assert response.json() == {
        "error": "payload_too_large",
        "detail": "Request body exceeds 1000 bytes.",
        "limit": 1000,
    }


@pytest.mark.parametrize("size", [1_048_577, 3 * 1024 * 1024])
def test_past_djangos_own_limit_it_is_a_413_too(api, member_setup, size):
    response = post_raw(api(member_setup[0]), "/api/jobs/", b"x" * size)
    assert response.status_code == 413 and response.json()["error"] == "payload_too_large"


# A literal past float range parses to infinity, which PostgreSQL's JSON cannot store (it was a
# 500); NaN and Infinity are not JSON at all. Each is refused with the JSON path of the number.
NOT_FINITE = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity"]


@pytest.mark.parametrize("number", NOT_FINITE)
def test_a_number_that_is_not_finite_in_a_job_is_a_400_naming_it(api, member_setup, number):
    body = json.dumps(chat_body("a")).replace('"max_tokens": 16', f'"max_tokens": 16, "temperature": {number}')
    response = post_raw(api(member_setup[0]), "/api/jobs/", body)
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "validation_error"
    assert list(response.json()["fields"]) == ["input.temperature"]
    assert not Job.objects.exists()


@pytest.mark.parametrize("number", NOT_FINITE)
def test_a_number_that_is_not_finite_in_a_bulk_is_a_400_naming_the_job(api, member_setup, number):
    jobs = [json.dumps(chat_body("a")) for _ in range(4)]
    jobs[3] = jobs[3].replace('"content": "hello"}', f'"content": "hello", "weight": [1, {number}]}}')
    response = post_raw(api(member_setup[0]), "/api/jobs/bulk/", '{"jobs": [' + ", ".join(jobs) + "]}")
    assert response.status_code == 400, response.content
    assert list(response.json()["fields"]) == ["jobs[3].input.messages[0].weight[1]"]
    assert not Job.objects.exists()


@pytest.mark.parametrize("number", NOT_FINITE)
@pytest.mark.parametrize("field", ["capabilities", "meta", "transport"])
def test_a_number_that_is_not_finite_in_an_executor_is_a_400_naming_it(api, operator, number, field):
    body = {"name": "e1", "kind": "sim", "capabilities": {"models": ["m"]}, "meta": {}, "transport": {}}
    raw = json.dumps(body).replace(f'"{field}": {{', f'"{field}": {{"x": {number}, ')
    raw = raw.replace(", }", "}")
    response = post_raw(api(operator), "/api/executors/", raw)
    assert response.status_code == 400, response.content
    assert list(response.json()["fields"]) == [f"{field}.x"]
    assert not Executor.objects.exists()


def test_large_finite_numbers_are_still_fine(api, member_setup):
    body = json.dumps(chat_body("a", meta={"big": 1e308, "small": -1e-308, "int": 10**30}))
    response = post_raw(api(member_setup[0]), "/api/jobs/", body)
    assert response.status_code == 201, response.content
    meta = Job.objects.get().meta
    # (PostgreSQL's jsonb keeps 1e308 as the exact decimal, which Python reads back as an int.)
    assert float(meta["big"]) == 1e308 and meta["small"] == -1e-308 and meta["int"] == 10**30
