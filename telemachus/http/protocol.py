"""uvicorn's HTTP protocol (httptools) with a deadline for a request's headers.

uvicorn bounds the idle time between requests on a kept-alive connection (`--timeout-keep-alive`,
and any byte received cancels it) and nothing else: a connection that sends nothing, or trickles a
header line every few seconds (slowloris), stays open as long as the client likes (a hostile probe
held 100 such connections for 60 s, and would have held them for good). Its maintainers listed a
`--timeout-request-start` as wanted in uvicorn issue #157 (2018); uvicorn 0.55 has none. ASGI
middleware cannot help either: the app is called only once the headers are complete.

So the protocol class is extended (uvicorn takes one by dotted path: `--http module:Class`,
telemachus/serve.py): from the moment a connection is made, or from the first byte of the next
request on a kept-alive one, the client has TELEMACHUS_HEADER_TIMEOUT_SECONDS to finish sending
the headers; past that the connection is closed. The deadline ends with the headers, so a request
whose answer takes long (a /v1/ call, a stream, the dashboard's socket) is never cut by it. One
timer per connection while headers are awaited: the same cost as uvicorn's keep-alive timer."""

import asyncio
from asyncio import TimerHandle

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeaderTimeoutHttpToolsProtocol(HttpToolsProtocol):
    header_deadline: TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline_arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # A kept-alive connection's next request: its headers get the same time. (The first
        # request's deadline runs from the connect, so waiting before the first byte buys nothing.)
        if self.header_deadline is None:
            self._header_deadline_arm()

    def on_headers_complete(self) -> None:
        self._header_deadline_disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_deadline_disarm()
        super().connection_lost(exc)

    def _header_deadline_arm(self) -> None:
        self.header_deadline = self.loop.call_later(settings.TELEMACHUS_HEADER_TIMEOUT_SECONDS, self._header_late)

    def _header_deadline_disarm(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _header_late(self) -> None:
        self.header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()
