"""A request for a Host not in ALLOWED_HOSTS is the client's doing: the server answers 400 and
logs one line (django.security.DisallowedHost), not the 40-line traceback Django attaches (a
scanner sending random Host headers turned the log into tracebacks). The API server's real log."""

import http.client
from urllib.parse import urlparse

import pytest

from tests.processes import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_bad_host_is_one_line_in_the_log(processes):
    base = processes.api_server("api")
    log_path = next(p.log_path for p in processes.procs if str(urlparse(base).port) in p.log_path.name)
    for path in ("/api/queue/", "/dashboard/", "/admin/login/"):
        conn = http.client.HTTPConnection(urlparse(base).hostname, urlparse(base).port, timeout=10)
        conn.request("GET", path, headers={"Host": "evil.example"})
        assert conn.getresponse().status == 400
        conn.close()

    def refusals() -> list[str]:
        return [line for line in log_path.read_text().splitlines() if "Invalid HTTP_HOST header" in line]

    wait_until(lambda: len(refusals()) >= 3, timeout=10, what="the three refusals in the log")
    log = log_path.read_text()
    assert len(refusals()) == 3, log
    assert all("django.security.DisallowedHost" in line and "'evil.example'" in line for line in refusals())
    assert "Traceback" not in log and "raise DisallowedHost" not in log, log
