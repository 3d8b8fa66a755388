"""The served process bounds the time a client takes to send a request's headers
(TELEMACHUS_HEADER_TIMEOUT_SECONDS, telemachus/http/protocol.py): 100 connections that trickled a
header line every 5 s used to stay open for as long as they liked (slowloris). Real sockets
against the API server as bin/run starts it; a request whose answer takes longer than the bound,
and a kept-alive connection's next request, are not cut."""

import socket
import time

import pytest

from scheduler.services.submit import job_submit
from tests.conftest import chat_body
from tests.credentials import token_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TIMEOUT = 2
SLOW = 20


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (EOF or a reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_slow_headers_are_cut_at_the_deadline(processes):
    base = processes.api_server(TELEMACHUS_HEADER_TIMEOUT_SECONDS=str(TIMEOUT))
    # Given connections that trickle a header line every 0.5 s, and one that sends nothing...
    slow = [connect(base) for _ in range(SLOW)]
    for sock in slow:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    silent = connect(base)
    started = time.monotonic()
    cut: dict[int, float] = {}
    while len(cut) < SLOW + 1 and time.monotonic() - started < 4 * TIMEOUT:
        time.sleep(0.5)
        for i, sock in enumerate([*slow, silent]):
            if i in cut:
                continue
            if closed_by_server(sock):
                cut[i] = time.monotonic() - started
            elif sock is not silent:
                try:
                    sock.sendall(b"X-Trickle: 1\r\n")
                except OSError:
                    cut[i] = time.monotonic() - started
    # Then the server closed every one of them at the deadline, not before and not much after.
    assert len(cut) == SLOW + 1, f"{SLOW + 1 - len(cut)} connections still open after {4 * TIMEOUT}s"
    assert all(TIMEOUT - 0.1 <= took <= TIMEOUT + 1.5 for took in cut.values()), sorted(cut.values())
    for sock in [*slow, silent]:
        sock.close()


def test_a_long_answer_and_a_kept_alive_connection_are_not_cut(processes, member_setup):
    # Given a job nobody runs (no worker), and a member's token...
    alice = member_setup[0]
    body = chat_body("a")
    job = job_submit(user=alice, team="a", type="chat", requirements=body["requirements"], input=body["input"])
    token = token_for(alice)
    base = processes.api_server(TELEMACHUS_HEADER_TIMEOUT_SECONDS=str(TIMEOUT))
    sock = connect(base)
    reader = sock.makefile("rb")

    def request(path: str) -> bytes:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Token {token}\r\n\r\n".encode())
        status = reader.readline()
        length = 0
        while (line := reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        reader.read(length)
        return status

    # When it waits on the job for longer than the header bound, on one kept-alive connection...
    assert request("/healthz").startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    assert request(f"/api/jobs/{job.id}/wait/?timeout={TIMEOUT + 2}").startswith(b"HTTP/1.1 200")
    assert time.monotonic() - started >= TIMEOUT + 1.5
    # ...then the long answer came whole, and the connection serves its next request, after a
    # pause shorter than uvicorn's keep-alive: the bound runs per request, from its first byte.
    time.sleep(1)
    assert request("/healthz").startswith(b"HTTP/1.1 200")
    sock.close()
