"""Feature switches: a job kind switched off (for everyone or for one team) is refused at submit
with 403 feature_disabled; a team's own switch wins over the global one."""

import pytest

from scheduler.models import Job
from scheduler.services.submit import job_submit
from telemachus.control.features import feature_enabled, feature_require
from telemachus.errors import FeatureDisabled
from tests.conftest import chat_body

pytestmark = pytest.mark.django_db


def switch(client, feature, enabled, team=None):
    return client.put("/api/features/", {"feature": feature, "team": team, "enabled": enabled}, format="json")


def test_a_switched_off_kind_is_refused_at_submit(api, operator, member_setup):
    alice = member_setup[0]
    assert switch(api(operator), "chat", False).status_code == 200

    response = api(alice).post("/api/jobs/", chat_body("a"), format="json")

    assert response.status_code == 403
    assert response.json() == {
        "error": "feature_disabled",
        "detail": "'chat' is switched off for team 'a'.",
        "feature": "chat",
        "team": "a",
    }
    assert not Job.objects.exists()


def test_a_team_switch_overrides_the_global_one(api, operator, member_setup):
    alice, bob, team_a, team_b, _ = member_setup
    client = api(operator)
    switch(client, "chat", False)
    switch(client, "chat", True, team="a")
    assert api(alice).post("/api/jobs/", chat_body("a"), format="json").status_code == 201
    assert api(bob).post("/api/jobs/", chat_body("b"), format="json").status_code == 403

    switch(client, "chat", None, team="a")  # back to following the global switch
    assert not feature_enabled(feature="chat", team=team_a)
    switch(client, "chat", True)
    switch(client, "chat", False, team="b")
    assert feature_enabled(feature="chat", team=team_a) and not feature_enabled(feature="chat", team=team_b)
    with pytest.raises(FeatureDisabled):
        feature_require(feature="chat", team=team_b)
    feature_require(feature="openai", team=None)  # untouched features are on


def test_states_read_by_everyone_switched_by_operators(api, operator, member_setup):
    alice = member_setup[0]
    switch(api(operator), "tool", False, team="a")
    states = api(alice).get("/api/features/").json()
    assert states["features"] == ["chat", "translate", "tool", "task", "flow", "openai"]
    assert states["global"]["tool"] is True and list(states["teams"]) == ["a"]
    assert states["teams"]["a"]["switches"]["tool"] is False and states["teams"]["a"]["effective"]["tool"] is False
    assert states["teams"]["a"]["switches"]["chat"] is None and states["teams"]["a"]["effective"]["chat"] is True
    response = switch(api(alice), "tool", True, team="a")
    assert response.status_code == 403 and response.json()["error"] == "forbidden"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"feature": "email", "enabled": False}, "feature"),
        ({"feature": "chat", "enabled": None}, "enabled"),
        ({"feature": "chat", "team": "nope", "enabled": False}, "team"),
        ({"feature": "chat", "enabled": "maybe"}, "enabled"),
        ({"feature": "chat", "enabled": False, "extra": 1}, "extra"),
    ],
)
def test_bad_input(api, operator, member_setup, body, field):
    response = api(operator).put("/api/features/", body, format="json")
    assert response.status_code == 400 and field in response.json()["fields"]


@pytest.mark.parametrize("kind", [Job.Type.CHAT, Job.Type.TASK])
def test_a_refusal_names_the_feature_plainly_whoever_submits(api, operator, member_setup, kind):
    """The OpenAI endpoint and the tasks backend submit with the Job.Type member, not a string: the
    refusal still reads 'chat', never the enum's repr."""
    alice = member_setup[0]
    switch(api(operator), kind.value, False)
    with pytest.raises(FeatureDisabled) as refused:
        job_submit(
            user=alice,
            team="a",
            type=kind,
            requirements={"model": "m"},
            input={"messages": [{"role": "user", "content": "hi"}]},
        )
    assert refused.value.body() == {
        "error": "feature_disabled",
        "detail": f"'{kind.value}' is switched off for team 'a'.",
        "feature": kind.value,
        "team": "a",
    }
    assert type(refused.value.body()["feature"]) is str
