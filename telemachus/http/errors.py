"""Errors that happen outside the API's views, in the API's JSON shape.

DRF's exception handler shapes what its views raise; everything else under /api/ and /v1/ (a URL
that matches no route, a method a plain Django view does not take, a CSRF failure, a body Django
refuses, a server error) would otherwise be one of Django's HTML pages. `ApiErrorMiddleware` turns
those into `{"error": code, "detail": ...}` under /api/ and into the OpenAI error shape under
/v1/, and refuses text PostgreSQL cannot store (NUL, lone surrogates) in paths, query strings and
headers before any view looks it up."""

import re
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.csrf import csrf_failure as django_csrf_failure

API_PREFIX, OPENAI_PREFIX = "/api/", "/v1/"
# Code points PostgreSQL refuses in text and jsonb (NUL) or that cannot be encoded as UTF-8 at all
# (surrogates not part of a pair, which json.loads lets through from "\ud800").
UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
ERROR_CODES = {
    400: "bad_request",
    401: "not_authenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    429: "throttled",
    500: "server_error",
    502: "bad_gateway",
    503: "unavailable",
}


def is_api_path(path: str) -> bool:
    return path.startswith((API_PREFIX, OPENAI_PREFIX))


def error_payload(path: str, *, status: int, code: str, detail: str, **extra: Any) -> dict[str, Any]:
    """The error body for `path`: ours under /api/, OpenAI's under /v1/ (what its SDKs parse)."""
    if path.startswith(OPENAI_PREFIX):
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return {"error": {"message": detail, "type": kind, "param": None, "code": code}}
    return {"error": code, "detail": detail, **extra}


def error_response(path: str, *, status: int, code: str, detail: str, **extra: Any) -> JsonResponse:
    return JsonResponse(error_payload(path, status=status, code=code, detail=detail, **extra), status=status)


def unstorable_input(request: HttpRequest) -> str | None:
    """Where the request carries text that cannot be stored or looked up, if anywhere."""
    if UNSTORABLE.search(request.path):
        return "path"
    for key, values in request.GET.lists():
        if UNSTORABLE.search(key) or any(UNSTORABLE.search(value) for value in values):
            return f"query parameter {key!r}"
    for key, value in request.META.items():
        if key.startswith("HTTP_") and isinstance(value, str) and UNSTORABLE.search(value):
            return f"header {key.removeprefix('HTTP_').replace('_', '-').title()}"
    return None


def _shaped(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    """Replace a non-JSON error page under /api/ or /v1/ by the JSON error shape. DRF's own
    responses are left alone: content negotiation may rightly have rendered them as HTML for a
    browser."""
    if (
        response.status_code < 400
        or not is_api_path(request.path)
        or getattr(response, "accepted_renderer", None) is not None
        or getattr(response, "streaming", False)
        or response.get("Content-Type", "").startswith("application/json")
    ):
        return response
    status = response.status_code
    code = ERROR_CODES.get(status, "error")
    detail = getattr(response, "reason_phrase", "") or code.replace("_", " ")
    if status == 405:
        detail = f"Method {request.method} not allowed."
    elif status == 404:
        detail = f"No endpoint at {request.path}."
    shaped = error_response(request.path, status=status, code=code, detail=detail)
    for header in ("Allow", "Retry-After"):
        if header in response:
            shaped[header] = response[header]
    return shaped


def _refusal(request: HttpRequest) -> HttpResponse | None:
    where = unstorable_input(request)
    if where is None:
        return None
    detail = f"The {where} contains a NUL character or an unpaired surrogate."
    if is_api_path(request.path):
        return error_response(request.path, status=400, code="validation_error", detail=detail)
    return HttpResponse(detail, status=400, content_type="text/plain; charset=utf-8")


class ApiErrorMiddleware:
    """Outermost middleware, so it also shapes what CSRF, security and common middleware answer."""

    sync_capable = async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse | Awaitable[HttpResponse]]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return _refusal(request) or _shaped(request, self.get_response(request))  # type: ignore[arg-type]

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        return _refusal(request) or _shaped(request, await self.get_response(request))  # type: ignore[misc]


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW: the reason in the JSON shape under /api/ and /v1/, Django's page elsewhere."""
    if is_api_path(request.path):
        return error_response(request.path, status=403, code="forbidden", detail=f"CSRF Failed: {reason}")
    return django_csrf_failure(request, reason=reason)
