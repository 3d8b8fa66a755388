"""The API's body limit at the ASGI edge: declared and undeclared (chunked) bodies, read whole and
handed on with their length, or refused with 413 in the JSON shape."""

import asyncio
import json
import socket

import pytest
from django.test import override_settings

from scheduler.models import Job
from telemachus.http.body_limit import BodyLimit
from tests.conftest import chat_body
from tests.processes import answers, free_port, wait_until


class Echo:
    """An inner app that reports the headers and body it was given."""

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        payload = json.dumps(
            {"headers": {k.decode(): v.decode() for k, v in scope["headers"]}, "body": body.decode()}
        ).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": payload})


def call(path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": "POST", "headers": headers}
    asyncio.run(BodyLimit(Echo())(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@override_settings(TELEMACHUS_MAX_BODY_BYTES=100)
def test_a_chunked_body_is_read_whole_and_given_its_length():
    status, echoed = call("/api/jobs/", [b'{"a": ', b'"b"}'], [(b"transfer-encoding", b"chunked")])
    assert status == 200
    assert echoed["body"] == '{"a": "b"}'
    assert echoed["headers"]["content-length"] == "10" and "transfer-encoding" not in echoed["headers"]


@override_settings(TELEMACHUS_MAX_BODY_BYTES=100)
@pytest.mark.parametrize("headers", [[(b"content-length", b"101")], [(b"transfer-encoding", b"chunked")]])
def test_a_body_over_the_limit_is_a_413_declared_or_not(headers):
    status, body = call("/api/jobs/", [b"x" * 60, b"x" * 41], headers)
    assert status == 413 and body == {
        "error": "payload_too_large",
        "detail": "Request body exceeds 100 bytes.",
        "limit": 100,
    }


@override_settings(TELEMACHUS_MAX_BODY_BYTES=100)
def test_under_v1_the_413_is_in_the_openai_shape():
    status, body = call("/v1/chat/completions", [b"x" * 200], [])
    assert status == 413 and body["error"]["code"] == "payload_too_large"


@override_settings(TELEMACHUS_MAX_BODY_BYTES=100)
def test_other_paths_are_left_to_django():
    status, echoed = call("/admin/login/", [b"x" * 200], [(b"content-length", b"200")])
    assert status == 200 and len(echoed["body"]) == 200


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("server", ["uvicorn", "daphne"])
def test_the_server_reads_a_chunked_job_and_refuses_a_huge_one(processes, member_setup, api, server):
    # Given the real ASGI app under either server bin/run may start...
    alice = member_setup[0]
    token = api(alice)._credentials["HTTP_AUTHORIZATION"]
    port = free_port()
    processes.spawn(
        server,
        "-m",
        "telemachus.serve",
        "127.0.0.1",
        str(port),
        TELEMACHUS_SERVER=server,
        TELEMACHUS_MAX_BODY_BYTES="100000",
    )
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/api/schema/"), timeout=30, what=f"{server} to listen")

    def raw_post(chunks: list[bytes]) -> tuple[int, dict]:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(
                b"POST /api/jobs/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Authorization: " + token.encode() + b"\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\n"
            )
            for chunk in chunks:
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.sendall(b"0\r\n\r\n")
            reply = b""
            while data := conn.recv(65536):
                reply += data
        head, _, body = reply.partition(b"\r\n\r\n")
        return int(head.split()[1]), json.loads(body)

    # When a job arrives chunked, without Content-Length, it is read, not taken as empty...
    raw = json.dumps(chat_body("a")).encode()
    status, job = raw_post([raw[:20], raw[20:]])
    assert status == 201, job
    assert Job.objects.get(pk=job["id"]).input["messages"][0]["content"] == "hello"
    # ...and one over the limit is a JSON 413.
    status, body = raw_post([b"x" * 60_000, b"x" * 60_000])
    assert status == 413 and body["error"] == "payload_too_large"


@pytest.mark.django_db(transaction=True)
def test_a_declared_body_up_to_twice_the_limit_is_read_before_its_413(processes, member_setup, api):
    # Given the real app under uvicorn, which (unlike daphne) calls the app before a body is read...
    token = api(member_setup[0])._credentials["HTTP_AUTHORIZATION"]
    port = free_port()
    processes.spawn("uvicorn", "-m", "telemachus.serve", "127.0.0.1", str(port), TELEMACHUS_MAX_BODY_BYTES="1048576")
    wait_until(lambda: answers(f"http://127.0.0.1:{port}/api/schema/"), timeout=30, what="uvicorn to listen")

    # ...when a body of 1.9 times the limit is sent whole, as a proxy in front sends it...
    body = b"x" * (2 * 1_048_576 - 100_000)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(
            b"POST /api/jobs/ HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: " + token.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        reply = b""
        while data := conn.recv(65536):
            reply += data

    # Then the 413 is read: the server read the rest before closing, where a reset would lose it.
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert int(head.split()[1]) == 413 and json.loads(payload)["error"] == "payload_too_large"
