"""Standard reason phrases on daphne's status lines.

An ASGI response carries a status code but no reason phrase: the server picks it. Daphne leaves
that to Twisted, whose table (twisted.web.http.RESPONSES) stops short of several codes this API
sends, 429 above all: without this, a throttled client reads `HTTP/1.1 429 Unknown Status`. The
missing codes are filled in from the standard library's table (RFC 9110 and friends); codes that
Twisted already names keep its phrase."""

from http import HTTPStatus


def reason_phrases_install() -> None:
    """Add the standard phrase of every status code Twisted's table lacks. Safe to call again;
    a no-op where Twisted is not installed (another ASGI server chooses its own phrases)."""
    try:
        from twisted.web import http as twisted_http
    except ImportError:
        return
    for status in HTTPStatus:
        twisted_http.RESPONSES.setdefault(status.value, status.phrase.encode("ascii"))
