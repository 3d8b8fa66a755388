"""The gateway's own request handling (what it answers before any job runs), on a running API server
behind a (pretend) TLS proxy: numbers that are not finite are a 400 naming the JSON path, never a
500; its responses carry the security headers Django's own responses carry."""

import httpx
import pytest

from scheduler.models import Job
from scheduler.services.submit import job_submit
from tests.processes import Processes
from tests.scheduler.gateway.conftest import may_chat, token

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

HSTS_SECONDS = 3600
DAPHNE_ENV = {"BEHIND_TLS_PROXY": "1", "SECURE_HSTS_SECONDS": str(HSTS_SECONDS)}
SECURITY_HEADERS = (
    "strict-transport-security",
    "x-content-type-options",
    "referrer-policy",
    "cross-origin-opener-policy",
)


@pytest.fixture(scope="module")
def base(django_db_setup, django_db_blocker, tmp_path_factory):
    """The API server alone, once per module: nothing here needs a worker or a model server."""
    processes = Processes(tmp_path_factory.mktemp("gateway"))
    try:
        with django_db_blocker.unblock():
            yield processes.api_server(**DAPHNE_ENV)
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


def security(response: httpx.Response) -> dict[str, str | None]:
    return {name: response.headers.get(name) for name in SECURITY_HEADERS}


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/nowhere"),
        ("GET", "/api/jobs/1/wait/"),
        ("GET", "/api/jobs/1/stream/"),
        ("POST", "/api/jobs/1/wait/"),
    ],
)
def test_gateway_answers_carry_the_headers_django_adds(base, method, path):
    # Given the same request to one of Django's own paths (it answers 401 too)...
    proxied = {"X-Forwarded-Proto": "https"}
    django = security(httpx.get(f"{base}/api/jobs/", headers=proxied))
    assert django["strict-transport-security"] == f"max-age={HSTS_SECONDS}", django
    # ...the gateway's answer (401, 404, 405) carries the same security headers...
    response = httpx.request(method, f"{base}{path}", headers=proxied)
    assert response.status_code in (401, 404, 405), response.text
    assert security(response) == django
    # ...and over plain HTTP, no HSTS, as Django.
    plain = httpx.request(method, f"{base}{path}")
    assert plain.headers.get("strict-transport-security") is None
    assert security(plain) == security(httpx.get(f"{base}/api/jobs/"))


def test_a_refusal_before_the_handler_and_a_stream_carry_them_too(base, alice):
    proxied = {"X-Forwarded-Proto": "https", "Authorization": f"Bearer {token(alice)}"}
    huge = httpx.post(f"{base}/v1/chat/completions", content=b"x" * 1_100_000, headers=proxied)
    assert huge.status_code == 413
    assert huge.headers["strict-transport-security"] == f"max-age={HSTS_SECONDS}"
    job = job_submit(user=alice, team="a", type="chat", requirements={"model": "m"}, input={"messages": []})
    with httpx.stream("GET", f"{base}/api/jobs/{job.pk}/stream/", headers=proxied, timeout=30) as stream:
        assert stream.status_code == 200
        assert stream.headers["strict-transport-security"] == f"max-age={HSTS_SECONDS}"
