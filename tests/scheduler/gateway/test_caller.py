"""Who a /v1/ call acts as: the team and its switch come from the configuration snapshot, so a
warm process reads only the credential, and a stale snapshot never refuses a call on its own."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from scheduler.gateway import shapes
from scheduler.gateway.calls import caller_for
from telemachus import errors
from telemachus.control.config import config_cache_clear, config_snapshot
from telemachus.control.features import OPENAI, feature_set
from telemachus.teams.services import team_member_set
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
    with pytest.raises(shapes.OpenAIError) as caught:
        call_as(secret, "b")
    assert (caught.value.status, caught.value.code) == (404, "team_not_found")
    with pytest.raises(shapes.OpenAIError) as caught:
        call_as(secret, "nowhere")
    assert caught.value.code == "team_not_found"
    team_member_set(team=other, username="alice", role="member")
    # Unconfirmed, the process may still act in the one team it knew (the submit checks alice is
    # in it under the version it confirms); a confirmed read knows she is in two.
    assert call_as(secret).team.slug == "a"
    with pytest.raises(shapes.OpenAIError) as caught:
        call_as(secret, confirm=True)  # now in two teams: the header is needed
    assert (caught.value.status, caught.value.code) == (400, "team_required")
    feature_set(feature=OPENAI, team=other, enabled=False, by=None)
    assert call_as(secret, "b").team.slug == "b"  # unconfirmed: the submit checks the switch again
    with pytest.raises(errors.FeatureDisabled):
        call_as(secret, "b", confirm=True)
    assert call_as(secret, "a", confirm=True).team.slug == "a"
