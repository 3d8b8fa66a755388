"""POST /api/users/: an operator sets a team up without the admin (user, token, membership)."""

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def test_an_operator_sets_up_a_team_over_the_api(api, operator, member_setup):
    client = api(operator)
    created = client.post("/api/users/", {"username": "erin", "email": "erin@example.com"}, format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["username"] == "erin" and body["invited"] is True and body["operator"] is False
    assert body["teams"] == {} and body["token"].startswith("tmu-") and len(body["token"]) == 36
    assert client.post("/api/teams/a/members/", {"username": "erin"}, format="json").status_code == 201

    # The invited user works at once with the token; no password sign-in until one is set.
    erin = APIClient()
    erin.credentials(HTTP_AUTHORIZATION=f"Token {body['token']}")
    assert erin.post("/api/jobs/", chat_body("a"), format="json").status_code == 201
    assert not get_user_model().objects.get(username="erin").has_usable_password()
    listed = {u["username"]: u for u in client.get("/api/users/").json()["results"]}
    assert listed["erin"]["teams"] == {"a": "member"} and listed["operator"]["operator"] is True


def test_operator_flag_and_password(api, operator):
    body = (
        api(operator)
        .post(
            "/api/users/",
            {"username": "olga", "password": "correct horse battery 9", "operator": True, "token": False},
            format="json",
        )
        .json()
    )
    assert body["operator"] is True and body["invited"] is False and body["token"] is None
    assert get_user_model().objects.get(username="olga").check_password("correct horse battery 9")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"username": "operator"}, "username"),
        ({"username": "has space"}, "username"),
        ({"username": "pat", "password": "123"}, "password"),
        ({"username": "pat", "is_superuser": True}, "is_superuser"),
    ],
)
def test_bad_input(api, operator, body, field):
    response = api(operator).post("/api/users/", body, format="json")
    assert response.status_code == 400 and field in response.json()["fields"]


def test_members_cannot_create_users(api, member_setup):
    response = api(member_setup[0]).post("/api/users/", {"username": "mallory"}, format="json")
    assert response.status_code == 403
    assert not get_user_model().objects.filter(username="mallory").exists()
