"""Who a /v1/ call acts as: the team and its switch come from the configuration snapshot, so a
warm process reads only the credential, and a stale snapshot never refuses a call on its own."""

import json
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from executors.models import Executor
from scheduler.gateway.anthropic import MESSAGES
from scheduler.gateway.caller import caller_for
from scheduler.gateway.calls import _submit
from scheduler.gateway.errors import GatewayError, from_domain
from scheduler.gateway.openai import CHAT
from scheduler.models import Job
from telemachus import errors
from telemachus.control.config import config_cache_clear, config_snapshot
from telemachus.control.features import OPENAI, feature_set
from telemachus.keys.models import ApiKey
from telemachus.keys.services import api_key_create, api_key_revoke
from telemachus.teams.services import team_member_remove, team_member_set
from tests.scheduler.gateway.conftest import token

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def cold_cache():
    config_cache_clear()
    yield
    config_cache_clear()


def call_as(secret: str, team: str | None = None, *, confirm: bool = False):
    return caller_for(authorization=f"Bearer {secret}", team=team, confirm=confirm, address="127.0.0.1")


def test_a_warm_process_reads_only_the_credential(make_user, make_team):
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    secret = token(alice)
    assert call_as(secret).team.slug == "a"  # warms the snapshot
    with CaptureQueriesContext(connection) as unconfirmed:
        assert call_as(secret).team.slug == "a"
    with CaptureQueriesContext(connection) as confirmed:
        assert call_as(secret, "a", confirm=True).team.slug == "a"
    assert len(confirmed) == len(unconfirmed) + 1  # the version read
    assert not any("telemachus_team" in q["sql"] or "membership" in q["sql"] for q in unconfirmed.captured_queries)


def test_a_stale_snapshot_is_read_again_before_a_refusal(make_user, make_team):
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    secret = token(alice)
    call_as(secret, "a")
    config_snapshot()  # the process's snapshot is now this version's, without team b
    make_team("b", {alice: "member"})  # moves the version in the database only
    assert call_as(secret, "b").team.slug == "b"


def test_what_a_confirmed_read_refuses_stays_refused(make_user, make_team):
    alice, bob = make_user("alice"), make_user("bob")
    make_team("a", {alice: "member"})
    other = make_team("b", {bob: "member"})
    secret = token(alice)
    with pytest.raises(errors.TeamNotFound):
        call_as(secret, "b")
    with pytest.raises(errors.TeamNotFound):
        call_as(secret, "nowhere")
    team_member_set(team=other, username="alice", role="member")
    # Unconfirmed, the process may still act in the one team it knew (the submit checks alice is
    # in it under the version it confirms); a confirmed read knows she is in two.
    assert call_as(secret).team.slug == "a"
    with pytest.raises(errors.TeamRequired):
        call_as(secret, confirm=True)  # now in two teams: the header is needed
    feature_set(feature=OPENAI, team=other, enabled=False, by=None)
    assert call_as(secret, "b").team.slug == "b"  # unconfirmed: the submit checks the switch again
    with pytest.raises(errors.FeatureDisabled):
        call_as(secret, "b", confirm=True)
    assert call_as(secret, "a", confirm=True).team.slug == "a"


def submit_as(secret: str, team: str | None = None, *, dialect=CHAT):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    return _submit(
        authorization=f"Bearer {secret}",
        team=team,
        priority=None,
        body=body,
        dialect=dialect,
        address="127.0.0.1",
        wake=False,
    )


def test_a_call_without_a_team_right_after_a_second_membership_is_refused_not_billed_to_the_first(make_user, make_team):
    # Given a process whose snapshot knows alice in one team...
    alice = make_user("alice")
    make_team("a", {alice: "member"})
    Executor.objects.create(
        name="x", kind="local-model", endpoint="http://127.0.0.1:9/v1", capabilities={"models": ["m"]}
    )
    secret = token(alice)
    caller, job, _ = submit_as(secret)
    assert caller.team.slug == job.team.slug == "a"

    # When she joins a second team (the database moves on, the process's snapshot does not) and
    # calls at once without naming a team...
    team_member_set(team=make_team("b"), username="alice", role="member")
    with pytest.raises(errors.TeamRequired) as caught:
        submit_as(secret)

    # Then the call is refused as ambiguous, as /v1/ answers it, and nothing was billed to team a.
    refusal = from_domain(caught.value)
    assert (refusal.status, refusal.code, refusal.param) == (400, "team_required", "x-telemachus-team")
    assert Job.objects.count() == 1


def test_a_team_left_is_refused_in_one_shape_however_stale_the_snapshot(make_user, make_team):
    alice, bob = make_user("alice"), make_user("bob")
    make_team("a", {alice: "member"})
    b = make_team("b", {alice: "member", bob: "member"})
    Executor.objects.create(
        name="x", kind="local-model", endpoint="http://127.0.0.1:9/v1", capabilities={"models": ["m"]}
    )
    secret = token(alice)
    submit_as(secret, "b")  # the snapshot knows her in b
    team_member_remove(team=b, user=alice)

    # The unconfirmed snapshot and the submit's confirmed read refuse alike: 404 team_not_found.
    refusals = []
    for _ in range(2):
        with pytest.raises(errors.TeamNotFound) as caught:
            submit_as(secret, "b")
        refusals.append(from_domain(caught.value))
    assert {(r.status, r.code, r.param) for r in refusals} == {(404, "team_not_found", "x-telemachus-team")}


def test_a_revoked_or_expired_key_is_told_so_in_the_protocols_own_header(make_user, make_team, api):
    alice = make_user("alice")
    team = make_team("a", {alice: "member"})
    revoked, revoked_secret = api_key_create(team=team, name="old", by=alice)
    api_key_revoke(key=revoked, by=alice)
    expired, expired_secret = api_key_create(
        team=team, name="short", by=alice, expires_at=timezone.now() + timedelta(minutes=1)
    )
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(seconds=1))  # time passes

    with pytest.raises(GatewayError) as caught:
        call_as(revoked_secret)
    assert caught.value.status == 401 and "revoked" in caught.value.message
    assert "Authorization: Bearer" in caught.value.message
    with pytest.raises(GatewayError) as caught:
        caller_for(
            authorization=f"Bearer {expired_secret}",
            team=None,
            confirm=False,
            address="127.0.0.1",
            api_key_header=MESSAGES.api_key_header,
        )
    assert caught.value.status == 401 and "expired" in caught.value.message
    assert "x-api-key: <key>" in caught.value.message and "Bearer" not in caught.value.message
    # The REST API says the same.
    client = api()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {revoked_secret}")
    answered = client.get("/api/jobs/")
    assert answered.status_code == 401 and "revoked" in answered.json()["detail"]
