"""Per-user submit throttle (DRF): configurable, only POSTs count, 429 throttled with Retry-After."""

import pytest
from django.test import override_settings

from scheduler.models import Job
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


@override_settings(TELEMACHUS_SUBMIT_RATE="3/min")
def test_submits_over_the_rate_are_throttled_per_user(api, member_setup):
    alice, bob, *_ = member_setup
    client = api(alice)
    statuses = [client.post("/api/jobs/", chat_body("a"), format="json").status_code for _ in range(5)]
    assert statuses == [201, 201, 201, 429, 429]
    refused = client.post("/api/jobs/", chat_body("a"), format="json")
    body = refused.json()
    assert body["error"] == "throttled" and 1 <= body["retry_after"] <= 60
    assert refused["Retry-After"] == str(body["retry_after"])
    assert Job.objects.count() == 3
    # Reading is never throttled, and another user has a rate of their own.
    assert client.get("/api/jobs/").status_code == 200
    assert api(bob).post("/api/jobs/", chat_body("b"), format="json").status_code == 201


@override_settings(TELEMACHUS_SUBMIT_RATE="")
def test_an_empty_rate_turns_it_off(api, member_setup):
    client = api(member_setup[0])
    assert {client.post("/api/jobs/", chat_body("a"), format="json").status_code for _ in range(20)} == {201}


@override_settings(TELEMACHUS_SUBMIT_RATE="10/min")
def test_a_bulk_submit_counts_each_job_against_the_rate(api, member_setup):
    alice, bob, *_ = member_setup
    client = api(alice)
    # Ten jobs in one call spend the minute's ten...
    assert client.post("/api/jobs/bulk/", {"jobs": [chat_body("a")] * 10}, format="json").status_code == 201
    refused = client.post("/api/jobs/", chat_body("a"), format="json")
    assert refused.status_code == 429 and refused.json()["error"] == "throttled"
    assert int(refused["Retry-After"]) >= 1
    again = client.post("/api/jobs/bulk/", {"jobs": [chat_body("a")]}, format="json")
    assert again.status_code == 429 and Job.objects.count() == 10


@override_settings(TELEMACHUS_SUBMIT_RATE="10/min")
def test_a_bulk_larger_than_the_rate_is_let_in_once_and_then_waited_for(api, member_setup):
    bob = member_setup[1]
    client = api(bob)
    # Thirty jobs at ten a minute: accepted when nothing is owed, then three minutes are owed.
    assert client.post("/api/jobs/bulk/", {"jobs": [chat_body("b")] * 30}, format="json").status_code == 201
    refused = client.post("/api/jobs/bulk/", {"jobs": [chat_body("b")]}, format="json")
    assert refused.status_code == 429
    assert 120 <= refused.json()["retry_after"] == int(refused["Retry-After"]) <= 180
