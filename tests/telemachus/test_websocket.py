"""The dashboard socket's origin check: scheme, host and port must be the socket's own (or a
trusted origin), so no other site, port or scheme on the same host can open it with a cookie."""

import pytest
from asgiref.sync import async_to_sync
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.testing import WebsocketCommunicator
from django.test import override_settings

from telemachus.http.websocket import SameOriginValidator


class Accepting(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        await self.accept()


def opens(origin: str | None, host: str = "127.0.0.1:8000", scheme: str = "ws", **extra: str) -> bool:
    headers = [(b"host", host.encode())] + ([(b"origin", origin.encode())] if origin is not None else [])
    headers += [(k.replace("_", "-").encode(), v.encode()) for k, v in extra.items()]
    communicator = WebsocketCommunicator(SameOriginValidator(Accepting.as_asgi()), "/ws/dashboard/", headers=headers)
    communicator.scope["scheme"] = scheme

    async def attempt() -> bool:
        connected, _ = await communicator.connect()
        if connected:
            await communicator.disconnect()
        return connected

    return async_to_sync(attempt)()


def test_the_sites_own_origin_opens_it():
    assert opens("http://127.0.0.1:8000")
    assert opens("https://localhost", host="localhost", scheme="wss")
    assert opens("http://LOCALHOST:80", host="localhost")


@pytest.mark.parametrize(
    "origin",
    [
        "http://127.0.0.1:9999",  # another port on the same host: another site
        "https://127.0.0.1:8000",  # another scheme
        "http://evil.example:8000",
        "http://127.0.0.1",  # port 80, not 8000
        "null",
        "",
        "http://127.0.0.1:notaport",
    ],
)
def test_other_origins_are_refused(origin):
    assert not opens(origin)


def test_no_origin_is_refused():
    assert not opens(None)


def test_a_host_not_allowed_is_refused():
    assert not opens("http://evil.example:8000", host="evil.example:8000")


@override_settings(CSRF_TRUSTED_ORIGINS=["https://dash.example.com"])
def test_trusted_origins_open_it():
    assert opens("https://dash.example.com")


@override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https"))
def test_behind_a_tls_proxy_the_origin_is_https():
    assert opens("https://localhost", host="localhost", x_forwarded_proto="https")
    assert not opens("http://localhost", host="localhost", x_forwarded_proto="https")


def test_without_the_proxy_setting_the_forwarded_scheme_is_ignored():
    assert not opens("https://localhost", host="localhost", x_forwarded_proto="https")
