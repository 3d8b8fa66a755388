import base64
from collections.abc import Iterable
from typing import Any
from urllib import parse

from django.db.models import QuerySet
from rest_framework.exceptions import NotFound
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request
from rest_framework.views import APIView

from telemachus.errors import ValidationFailed

# Cursor positions are primary keys (bigint); anything outside that range cannot name a row.
POSITION_RANGE = (-(2**63), 2**63 - 1)
# DRF's `?format=json` (URL_FORMAT_OVERRIDE) is accepted everywhere.
ALWAYS_ACCEPTED = frozenset({"format"})


def query_params_check(request: Request, accepted: Iterable[str]) -> None:
    """Refuse query parameters a list does not define: a misspelt filter (`?stauts=queued`) would
    otherwise silently return everything."""
    unknown = sorted(set(request.query_params) - set(accepted) - ALWAYS_ACCEPTED)
    if unknown:
        known = ", ".join(sorted(set(accepted))) or "none"
        raise ValidationFailed({name: [f"Unknown query parameter; this list accepts: {known}."] for name in unknown})


class NewestFirstCursorPagination(CursorPagination):
    """Cursor pagination stays stable while new rows arrive, unlike page numbers or offsets.

    Strict about its input: a page_size that is not an integer from 1 to max_page_size, a cursor
    this API did not hand out, and a query parameter that is neither the view's filter (its
    `filter_serializer`'s fields) nor pagination's are 400 validation errors, never ignored."""

    ordering = "-id"
    page_size_query_param = "page_size"
    max_page_size = 500

    def paginate_queryset(self, queryset: QuerySet, request: Request, view: APIView | None = None) -> list | None:  # type: ignore[override]
        filters = getattr(view, "filter_serializer", None)
        query_params_check(
            request,
            [self.cursor_query_param, self.page_size_query_param, *(filters().fields if filters is not None else ())],
        )
        return super().paginate_queryset(queryset, request, view)

    def get_page_size(self, request: Request) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size  # type: ignore[return-value]
        if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= self.max_page_size):
            raise ValidationFailed({self.page_size_query_param: [f"An integer from 1 to {self.max_page_size}."]})
        return int(raw)

    def decode_cursor(self, request: Request) -> Cursor | None:
        invalid = ValidationFailed({self.cursor_query_param: ["Invalid cursor."]})
        encoded = request.query_params.get(self.cursor_query_param)
        if encoded is not None and not _cursor_shaped(encoded):
            # DRF's decoding skips what is not base64 and reads nothing as the first page, so
            # `?cursor=!!` would list from the start as if the client had asked for that.
            raise invalid
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            raise invalid from None
        if cursor is None or cursor.position is None:
            return cursor
        digits = cursor.position.removeprefix("-")  # type: ignore[attr-defined]
        low, high = POSITION_RANGE
        if not (digits.isascii() and digits.isdigit() and low <= int(cursor.position) <= high):
            raise invalid
        return cursor

    def get_schema_operation_parameters(self, view: APIView) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"] = {"type": "integer", "minimum": 1, "maximum": self.max_page_size}
        return parameters


def _cursor_shaped(encoded: str) -> bool:
    """Whether `encoded` is a cursor as CursorPagination.encode_cursor writes them: strict base64
    of a query string with nothing but its keys (`o` offset, `r` reverse, `p` position), each
    once, and at least one of them (every cursor handed out says where, or which way, it goes)."""
    try:
        querystring = base64.b64decode(encoded.encode("ascii"), validate=True).decode("ascii")
        tokens = parse.parse_qs(querystring, keep_blank_values=True, strict_parsing=True)
    except (ValueError, UnicodeError):
        return False
    return (
        bool(tokens)
        and set(tokens) <= {"o", "r", "p"}
        and all(len(values) == 1 for values in tokens.values())
        and tokens.get("r", ["1"]) == ["1"]
    )


class OldestFirstCursorPagination(NewestFirstCursorPagination):
    ordering = "id"
