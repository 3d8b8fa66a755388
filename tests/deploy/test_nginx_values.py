"""deploy/nginx/telemachus.conf's numbers against the app's settings (no nginx needed): what a live
test cannot wait for, a ten-minute model call, is checked by its numbers here."""

import re

from django.conf import settings

from scheduler.gateway.jobwatch import MAX_TIMEOUT
from tests.deploy.nginx import SHIPPED

SIZES = {"k": 1024, "m": 1024**2, "g": 1024**3}


def directive(name: str) -> list[str]:
    return re.findall(rf"^\s*{name}\s+([^;]+);", SHIPPED.read_text(), re.M)


def seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)?", value).groups()  # type: ignore[union-attr]
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[unit]


def test_the_proxy_waits_longer_than_the_gateway_and_the_job_waits():
    # The app answers a /v1/ call within TELEMACHUS_GATEWAY_TIMEOUT_SECONDS (a 504 of its own), and
    # a job wait within its timeout: nginx must not cut either first (its default is 60 s).
    longest = max(settings.TELEMACHUS_GATEWAY_TIMEOUT_SECONDS, MAX_TIMEOUT)
    for name in ("proxy_read_timeout", "proxy_send_timeout"):
        (value,) = directive(name)  # one, at the server level: every location inherits it
        assert seconds(value) > longest, (name, value, longest)


def size(value: str) -> int:
    return int(value[:-1]) * SIZES[value[-1].lower()] if value[-1].isalpha() else int(value)


def test_bodies_the_app_accepts_pass_the_proxy():
    # The server's limit: above the app's, so the app's JSON 413 answers, and at most twice it,
    # which the app reads of a refused body before answering (telemachus/http/body_limit.py).
    shipped = SHIPPED.read_text()
    files = re.search(r"location = /v1/files \{([^}]*)\}", shipped)
    assert files is not None
    (value,) = re.findall(r"^\s*client_max_body_size\s+([^;]+);", shipped.replace(files.group(0), ""), re.M)
    assert settings.TELEMACHUS_MAX_BODY_BYTES < size(value) <= 2 * settings.TELEMACHUS_MAX_BODY_BYTES
    # Batch input files: up to the app's own limit for them, and a little form framing.
    (upload,) = re.findall(r"client_max_body_size\s+([^;]+);", files.group(1))
    assert size(upload) > settings.TELEMACHUS_BATCH_FILE_MAX_BYTES
