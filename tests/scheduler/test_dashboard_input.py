"""What the dashboard's socket does with input the API refuses: it answers with the API's error
(the same parser checks and serializers, naming the field) and stays open, never closing with 1011
(a server error)."""

import pytest
from asgiref.sync import async_to_sync

from scheduler.models import QueuePolicy
from tests.scheduler.test_dashboard import receive_reply, receive_state, signed_in, socket

pytestmark = pytest.mark.django_db(transaction=True)


def exchange(session: str, messages: list[str | bytes]) -> tuple[list[dict], bool]:
    """Send each raw frame, collect its reply; then whether the socket still answers an action."""

    async def scenario():
        communicator = socket(session)
        assert (await communicator.connect())[0]
        await receive_state(communicator)
        replies = []
        for raw in messages:
            if isinstance(raw, bytes):
                await communicator.send_to(bytes_data=raw)
            else:
                await communicator.send_to(text_data=raw)
            replies.append(await receive_reply(communicator))
        await communicator.send_json_to({"id": "still", "action": "reboot"})
        alive = (await receive_reply(communicator))["reply"] == "still"
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
