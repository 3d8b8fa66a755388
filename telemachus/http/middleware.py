"""Request middleware of the project."""

from collections.abc import Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

from telemachus.control.audit import audit_source
from telemachus.models import AuditEvent


def request_source(path: str) -> str:
    """Which surface a request came through, for the audit log."""
    if path.startswith("/admin/"):
        return AuditEvent.Source.ADMIN
    if path.startswith(("/api/", "/v1/")):
        return AuditEvent.Source.API
    return AuditEvent.Source.WEB


class AuditSourceMiddleware:
    """Marks the changes a request makes with the surface it came through (admin, API, web), so the
    services that audit them need not know. Works for sync and async views alike."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if iscoroutinefunction(self):
            return self.__acall__(request)  # type: ignore[attr-defined]
        with audit_source(request_source(request.path)):
            return self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        with audit_source(request_source(request.path)):
            return await self.get_response(request)
