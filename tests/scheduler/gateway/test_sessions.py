"""X-Telemachus-Session on /v1/: the calls of one conversation prefer the executor that served its
last call (round affinity for apps that run their own agent loop), through the API server, a real worker
and a real model server."""

import httpx
import pytest

from executors.models import Executor
from scheduler.models import Job
from tests.scheduler.gateway.conftest import may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def alice(member_setup):
    alice, *_rest, shared = member_setup
    shared.delete()
    return may_chat(alice)


def call(stack, user, session: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token(user)}"}
    if session is not None:
        headers["X-Telemachus-Session"] = session
    return httpx.post(
        f"{stack.base}/v1/chat/completions",
        headers=headers,
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=30,
    )


def served_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return Job.objects.get(pk=int(response.headers["x-telemachus-job"])).executor.name


def test_a_sessions_calls_stay_on_the_executor_of_its_first(stack, alice):
    # Given two executors, and a conversation whose first call ran on x...
    stack.executor(stack.simllm, name="x")
    stack.executor(stack.simllm, name="y")
    assert served_by(call(stack, alice, session="trip-planning")) == "x"

    # When y becomes the executor placement likes best (heavier, the same load)...
    Executor.objects.filter(name="y").update(weight=5)

    # Then the conversation's next calls still go to x, while calls of no session, or of a new
    # one, go to y.
    assert [served_by(call(stack, alice, session="trip-planning")) for _ in range(4)] == ["x"] * 4
    assert served_by(call(stack, alice)) == "y"
    assert served_by(call(stack, alice, session="another")) == "y"
    # The session is the team's: its jobs carry it.
    assert set(Job.objects.filter(affinity_key="trip-planning").values_list("executor__name", flat=True)) == {"x"}


def test_a_session_name_is_bounded(stack, alice):
    stack.executor(stack.simllm)
    response = call(stack, alice, session="s" * 201)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-telemachus-session"
