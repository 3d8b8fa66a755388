"""Errors outside the API's views answer in the API's JSON shape: no route, a method a plain view
does not take, a CSRF failure; text PostgreSQL cannot store never reaches a lookup."""

import pytest
from django.test import Client

from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert body["error"] == code and body["detail"], body
    return body


@pytest.mark.parametrize("path", ["/api/jobs/abc/", "/api/nothing/", "/api/jobs/1/nope/", "/api/"])
def test_a_path_that_matches_no_route_is_a_json_404(api, operator, path):
    assert_error(api(operator).get(path), 404, "not_found")


def test_unknown_v1_path_answers_in_the_openai_error_shape(api, operator):
    response = api(operator).post("/v1/no/such/thing", {}, format="json")
    assert response.status_code == 404 and response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["type"] == "invalid_request_error" and error["message"]


def test_other_paths_keep_django_pages():
    response = Client().get("/no-such-page/")
    assert response.status_code == 404 and not response["Content-Type"].startswith("application/json")


def test_csrf_failure_on_an_api_view_is_json(member_setup):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(member_setup[0])
    body = assert_error(browser.post("/api/jobs/", chat_body("a"), content_type="application/json"), 403, "forbidden")
    assert "CSRF" in body["detail"]


def test_method_not_allowed_on_an_api_view_is_json(api, operator):
    assert_error(api(operator).delete("/api/queue/"), 405, "method_not_allowed")


@pytest.mark.parametrize(
    "path",
    [
        "/api/teams/a/members/x%00y/",
        "/api/teams/a%00/",
        "/api/jobs/?team=a%00",
        "/api/jobs/?sta%00tus=queued",
        "/api/usage/?user=%00",
    ],
)
def test_nul_in_a_path_or_query_is_a_400(api, operator, member_setup, path):
    client = api(operator)
    method = client.delete if "members" in path else client.get
    body = assert_error(method(path), 400, "validation_error")
    assert "NUL" in body["detail"]


def test_nul_in_a_header_is_a_400(api, operator):
    assert_error(api(operator).get("/api/jobs/", HTTP_X_TELEMACHUS_TEAM="a\x00"), 400, "validation_error")


def test_nul_in_a_token_is_a_400_not_a_lookup(api):
    assert_error(api().get("/api/jobs/", HTTP_AUTHORIZATION="Token abc\x00def"), 400, "validation_error")


def test_nul_outside_the_api_is_a_plain_400(operator):
    browser = Client()
    browser.force_login(operator)
    response = browser.get("/admin/auth/user/%00/change/")
    assert response.status_code == 400


def test_a_unique_violation_no_service_guards_is_a_409_conflict(make_team):
    # Given a write that breaks a unique constraint past every check (here a raw update)...
    from django.db import IntegrityError, transaction

    from telemachus.http.exception_handler import exception_handler
    from telemachus.models import Team

    make_team("lab")
    other = make_team("other")
    with pytest.raises(IntegrityError) as raised, transaction.atomic():
        Team.objects.filter(pk=other.pk).update(slug="lab")
    # ...the API's one handler answers it as a conflict, in the API's shape, not a 500.
    answer = exception_handler(raised.value, {})
    assert answer is not None and answer.status_code == 409
    assert answer.data["error"] == "conflict"
