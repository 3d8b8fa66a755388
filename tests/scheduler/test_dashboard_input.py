"""What the dashboard's socket does with input the API refuses: it answers with the API's error
(the same parser checks and serializers, naming the field) and stays open, never closing with 1011
(a server error)."""

import pytest
from asgiref.sync import async_to_sync

from executors.models import Executor
from scheduler.models import Job, QueuePolicy
from scheduler.services.submit import job_submit
from telemachus.models import FeatureSwitch
from tests.scheduler.test_dashboard import receive_reply, receive_state, signed_in, socket

pytestmark = pytest.mark.django_db(transaction=True)


def exchange(session: str, messages: list[str | bytes]) -> tuple[list[dict], bool]:
    """Send each raw frame, collect its reply; then whether the socket still answers an action."""

    async def scenario():
        communicator = socket(session)
        assert (await communicator.connect())[0]
        await receive_state(communicator)
        replies = []
        try:
            for raw in messages:
                kind = "bytes" if isinstance(raw, bytes) else "text"
                await communicator.send_input({"type": "websocket.receive", kind: raw})
                replies.append(await receive_reply(communicator))
            await communicator.send_json_to({"id": "still", "action": "reboot"})
            alive = (await receive_reply(communicator))["reply"] == "still"
        finally:
            await communicator.disconnect()
        return replies, alive

    return async_to_sync(scenario)()


@pytest.fixture
def session(operator, member_setup, settings):
    settings.TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = 2
    return signed_in(operator)


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity"])
def test_a_number_that_is_not_finite_is_answered_naming_it(session, number):
    raw = '{"id": 1, "action": "policy.update", "changes": {"default_weight": NUMBER}}'.replace("NUMBER", number)
    (reply,), alive = exchange(session, [raw])
    assert reply["ok"] is False and reply["error"]["error"] == "validation_error"
    assert list(reply["error"]["fields"]) == ["changes.default_weight"]
    assert alive
    assert not QueuePolicy.objects.exclude(default_weight=1.0).exists()


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    "raw, field",
    [
        ('{"id": 1, "action": "policy.update", "changes": {"team_weights": ' + deep(100_000) + "}}", None),
        ('{"id": 1, "action": "policy.update", "changes": {"team_weights": ' + deep(70) + "}}", "changes.team_weights"),
        ('{"id": 1, "action": "executor.update", "executor": "abc", "changes": {"enabled": false}}', "executor"),
        ('{"id": 1, "action": "executor.update", "executor": 1e30, "changes": {"enabled": false}}', "executor"),
        ('{"id": 1, "action": "job.cancel", "job": 100000000000000000000}', "job"),
        ('{"id": 1, "action": "job.requeue", "job": "1; drop"}', "job"),
        ('{"id": 1, "action": "job.cancel", "job": true}', "job"),
        ('{"id": 1, "action": ["policy.update"]}', "action"),
        (
            '{"id": 1, "action": "feature.set", "changes": {"feature": "chat", "team": "a\\u0000", "enabled": false}}',
            "changes.team",
        ),
        ('{"id": 1, "action": "policy.update", "changes": {"team_weights": {"\\u0000": 1}}}', "changes.team_weights"),
        (
            '{"id": 1, "action": "feature.set", "changes": {"feature": "chat\\ud800", "enabled": false}}',
            "changes.feature",
        ),
        ('{"id": 1, "action": "job.cancel", "job": 1, "extra": 2}', "extra"),
        ("", None),
        (b"\x00\x01binary", None),
    ],
    ids=[
        "nested-past-the-parser",
        "nested-past-the-limit",
        "executor-not-an-integer",
        "executor-a-float",
        "job-past-bigint",
        "job-a-string",
        "job-a-boolean",
        "action-a-list",
        "nul-in-a-value",
        "nul-in-a-key",
        "lone-surrogate",
        "unknown-key",
        "empty-frame",
        "binary-frame",
    ],
)
def test_bad_actions_are_answered_and_the_socket_stays_open(session, member_setup, raw, field):
    # Given an operator's open dashboard and a queued job...
    job_submit(user=member_setup[0], team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    # When it sends an action the API would refuse...
    (reply,), alive = exchange(session, [raw])
    # Then it hears the API's validation error, naming the field, and the socket stays open.
    assert reply["ok"] is False and reply["error"]["error"] == "validation_error", reply
    if field is not None:
        assert any(name.startswith(field) for name in reply["error"]["fields"]), reply
    assert alive
    assert Job.objects.get().status == "queued" and not FeatureSwitch.objects.exists()
    assert Executor.objects.get().enabled is True
