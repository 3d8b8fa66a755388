"""The gateway's own request handling (what it answers before any job runs), on a running daphne:
numbers that are not finite are a 400 naming the JSON path, never a 500."""

import httpx
import pytest

from scheduler.models import Job
from tests.processes import Processes
from tests.scheduler.gateway.conftest import may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def base(django_db_setup, django_db_blocker, tmp_path_factory):
    """daphne alone, once per module: nothing here needs a worker or a model server."""
    processes = Processes(tmp_path_factory.mktemp("gateway"))
    try:
        with django_db_blocker.unblock():
            yield processes.daphne()
    finally:
        processes.stop_all()


@pytest.fixture
def alice(member_setup):
    return may_chat(member_setup[0])


def post_raw(base: str, user, path: str, raw: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token(user)}", "Content-Type": "application/json"}
    return httpx.post(f"{base}{path}", content=raw.encode(), headers=headers, timeout=30)


CHAT = '{"model": "m", "messages": [{"role": "user", "content": "hi"%s}]%s}'


@pytest.mark.parametrize("number", ["1e999", "-1e999", "NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    "raw, param",
    [
        (CHAT % ("", ', "logit_bias": {"50256": %s}'), "logit_bias.50256"),
        (CHAT % (', "weight": %s', ""), "messages[0].weight"),
        (
            CHAT
            % (
                "",
                ', "tools": [{"type": "function", "function": {"name": "f", "parameters": '
                '{"type": "object", "properties": {"x": {"type": "number", "maximum": %s}}}}}]',
            ),
            "tools[0].function.parameters.properties.x.maximum",
        ),
        (CHAT % ("", ', "temperature": %s'), "temperature"),
    ],
    ids=["logit_bias", "message-key", "tool-parameters", "temperature"],
)
def test_a_number_that_is_not_finite_is_a_400_naming_it(base, alice, raw, param, number):
    response = post_raw(base, alice, "/v1/chat/completions", raw % number)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert not Job.objects.exists()


def test_embeddings_too(base, alice):
    response = post_raw(base, alice, "/v1/embeddings", '{"model": "m", "input": "x", "dimensions": 1e999}')
    assert response.status_code == 400 and response.json()["error"]["param"] == "dimensions", response.text
