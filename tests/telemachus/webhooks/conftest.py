import httpx
import pytest

from tests.processes import answers, free_port, wait_until


class Receiver:
    """The receiver process (tests/telemachus/webhooks/receiver.py), and what it has seen."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.url = f"{base}/hooks/telemachus"

    def configure(self, **settings: object) -> None:
        httpx.post(f"{self.base}/_control", json=settings).raise_for_status()

    def seen(self) -> dict:
        return httpx.get(f"{self.base}/_received").json()

    def accepted(self) -> list[dict]:
        return self.seen()["accepted"]


@pytest.fixture
def receiver(processes):
    port = free_port()
    processes.spawn(f"receiver-{port}", "-m", "tests.telemachus.webhooks.receiver", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: answers(f"{base}/_received"), timeout=20, what="the webhook receiver to listen")
    return Receiver(base)


@pytest.fixture
def private_allowed(settings):
    """Webhooks may go to loopback addresses (the only ones tests may reach)."""
    settings.TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE = True
