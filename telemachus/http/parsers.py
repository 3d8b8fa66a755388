import io
import json
import math
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from telemachus.errors import PayloadTooLarge, ValidationFailed
from telemachus.http.errors import UNSTORABLE

# Deeper than any request the API defines (a flow's messages with tool calls nest about 8 levels);
# far below what would exhaust the stack of the parser, the database's JSON functions or a renderer.
MAX_DEPTH = 64


class BoundedJSONParser(JSONParser):
    """JSON parser with a body-size limit, a nesting limit, only storable text and only finite
    numbers.

    DRF reads the request stream directly, which bypasses Django's DATA_UPLOAD_MAX_MEMORY_SIZE, so
    the size limit is enforced here too (telemachus/http/body_limit.py enforces it first under ASGI): by
    Content-Length when given, and by reading at most limit + 1 bytes otherwise. A body nested
    deeper than MAX_DEPTH, with a NUL or an unpaired surrogate in any key or string (PostgreSQL
    stores neither), or with a number that is not finite (`NaN`, `Infinity`, or a literal such as
    `1e999` that overflows to infinity: PostgreSQL's JSON has no such values), is refused as a whole
    with the JSON path of the first offence (`input.temperature`, `jobs[3].input.messages[0]`).
    DRF's strict mode would refuse `NaN` too, but without saying where: it is parsed here and
    refused by `json_problem` like `1e999`."""

    strict = False

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        limit = settings.TELEMACHUS_MAX_BODY_BYTES
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        too_large = PayloadTooLarge(f"Request body exceeds {limit} bytes.", limit=limit)
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large
        body = stream.read(limit + 1) if stream is not None else b""
        if len(body) > limit:
            raise too_large
        try:
            data = super().parse(io.BytesIO(body), media_type, parser_context)
        except RecursionError:
            raise ParseError(f"JSON parse error - nested deeper than {MAX_DEPTH} levels.") from None
        problem = json_problem(data)
        if problem is not None:
            path, message = problem
            raise ValidationFailed({path or "body": [message]})
        return data


def json_parse(raw: str | bytes) -> Any:
    """Parse JSON as the API does: `NaN` and `Infinity` become floats (as `1e999` does), for
    `json_problem` to refuse with their path. Raises ValueError (malformed) or RecursionError."""
    return json.loads(raw, parse_constant=float)


def json_path(path: str, key: str | int) -> str:
    """`path` extended by an object key (`a.b`) or a list index (`a[3]`)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def json_problem(data: Any, *, root: str = "") -> tuple[str, str] | None:
    """The first place in parsed JSON that the API refuses, as (JSON path, message), or None; paths
    start at `root` (`jobs[3]`). Iterative, so a deep document cannot exhaust the stack here
    either."""
    stack: list[tuple[Any, str, int]] = [(data, root, 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if UNSTORABLE.search(value):
                return path, "Text may not contain NUL characters or unpaired surrogates."
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                return path, "Numbers must be finite (no NaN or Infinity, nor a literal that overflows to it)."
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            return path, f"Nested deeper than {MAX_DEPTH} levels."
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in reversed(list(items)):
            if isinstance(key, str) and UNSTORABLE.search(key):
                return path, "Keys may not contain NUL characters or unpaired surrogates."
            stack.append((item, json_path(path, key), depth + 1))
    return None
