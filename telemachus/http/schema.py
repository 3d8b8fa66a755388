"""OpenAPI schema additions: every operation declares the error responses the API can give, in the
one JSON error shape (telemachus/errors.py), so clients and schema-driven tests know them."""

from typing import Any

from django.conf import settings
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

ERROR_SCHEMA = {
    "type": "object",
    "description": "The API's error shape: a machine-readable code, a human detail, sometimes more.",
    "properties": {
        "error": {"type": "string", "example": "validation_error"},
        "detail": {"type": "string"},
        "fields": {
            "type": "object",
            "additionalProperties": True,
            "description": "validation_error: the messages for each offending field",
        },
        "retry_after": {"type": "integer", "description": "try_later, throttled: seconds to wait"},
        "reset_at": {"type": "string", "format": "date-time", "description": "quota_exceeded: when the budget resets"},
    },
    "required": ["error", "detail"],
    "additionalProperties": True,
}
ANY_OPERATION = {
    "400": "Invalid input (validation_error, parse_error) or query parameter",
    "401": "Not authenticated",
    "403": "Forbidden: names the missing permission",
    "404": "Not found (also another team's object: existence never leaks)",
    "405": "Method not allowed",
    "429": "Throttled or try later (Retry-After)",
}
WITH_BODY = {
    "409": "Conflict with the object's state",
    "413": "Request body too large (payload_too_large)",
    "415": "Unsupported media type (send application/json)",
}


def declare_errors(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: add the Error component and the error responses."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    reference = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method not in {"get", "post", "put", "patch", "delete"}:
                continue
            declared = operation.setdefault("responses", {})
            errors = {**ANY_OPERATION, **(WITH_BODY if method != "get" else {})}
            for status, description in errors.items():
                declared.setdefault(status, {"description": description, "content": reference})
    return result


class SchemaVisible(BasePermission):
    """Who may read /api/schema/ and /api/docs/: anyone with TELEMACHUS_PUBLIC_SCHEMA (the default
    with DEBUG on), else only a signed-in person or a caller with a token or key (401 otherwise).
    The schema lists every endpoint, parameter and error of the API: useful to its callers, and to
    someone looking for a way in, who has no other use for it."""

    message = "The API schema is for signed-in users here (TELEMACHUS_PUBLIC_SCHEMA is off)."

    def has_permission(self, request: Request, view: object) -> bool:
        return bool(settings.TELEMACHUS_PUBLIC_SCHEMA or request.user.is_authenticated)
