"""The API's one exception handler: domain errors, DRF errors and Django's 404/403 in one JSON shape."""

import math

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig
from django.db import IntegrityError
from django.http import Http404
from rest_framework import exceptions as drf
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from telemachus.errors import Conflict, DomainError, PayloadTooLarge, unique_violation

_DRF_CODES = {
    drf.NotAuthenticated: "not_authenticated",
    drf.AuthenticationFailed: "not_authenticated",
    drf.PermissionDenied: "forbidden",
    drf.NotFound: "not_found",
    drf.MethodNotAllowed: "method_not_allowed",
    drf.NotAcceptable: "not_acceptable",
    drf.UnsupportedMediaType: "unsupported_media_type",
    drf.ParseError: "parse_error",
    drf.Throttled: "throttled",
}


def exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, RequestDataTooBig):
        # DRF reads the whole body through Django, which refuses past DATA_UPLOAD_MAX_MEMORY_SIZE.
        limit = settings.TELEMACHUS_MAX_BODY_BYTES
        exc = PayloadTooLarge(f"Request body exceeds {limit} bytes.", limit=limit)
    if isinstance(exc, IntegrityError) and unique_violation(exc):
        # A write that raced an identical one past the checks its service makes: the row exists
        # now. The services that create rows say which field (telemachus.errors.unique_or); this
        # is the net under any other.
        exc = Conflict("It was created or changed by another request meanwhile; read it again.")
    if isinstance(exc, DomainError):
        return Response(exc.body(), status=exc.status, headers=exc.headers())
    if isinstance(exc, Http404):
        exc = drf.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = drf.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, drf.ValidationError):
        fields = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        response.data = {"error": "validation_error", "detail": "Invalid input.", "fields": fields}
    else:
        code = next((c for cls, c in _DRF_CODES.items() if isinstance(exc, cls)), "error")
        response.data = {"error": code, "detail": str(getattr(exc, "detail", exc))}
        if isinstance(exc, drf.Throttled) and exc.wait is not None:  # type: ignore[attr-defined]
            response.data["retry_after"] = math.ceil(exc.wait)  # type: ignore[attr-defined]
    return response
