"""Domain errors. Services raise these; views never build error responses themselves, the one
exception handler (telemachus/http/exception_handler.py) turns them into the API's JSON shape: a
machine-readable `error` code, a human `detail`, and sometimes more (per-field errors, reset_at)."""

from typing import Any


class DomainError(Exception):
    code = "error"
    status = 400
    default_detail = "Request failed."

    def __init__(self, detail: str | None = None, **extra: Any) -> None:
        self.detail = detail or self.default_detail
        self.extra = extra
        super().__init__(self.detail)

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "detail": self.detail, **self.extra}

    def headers(self) -> dict[str, str]:
        return {}


class ValidationFailed(DomainError):
    """Bad input; `fields` maps each offending field to its messages."""

    code = "validation_error"
    default_detail = "Invalid input."

    def __init__(self, fields: dict[str, Any], detail: str | None = None) -> None:
        super().__init__(detail, fields=fields)


class UnknownModel(DomainError):
    code = "unknown_model"
    default_detail = "No enabled executor that this team may use offers that model."


class Forbidden(DomainError):
    code = "forbidden"
    status = 403
    default_detail = "You do not have permission to do that."


class NotFound(DomainError):
    code = "not_found"
    status = 404
    default_detail = "Not found."


class Conflict(DomainError):
    code = "conflict"
    status = 409
    default_detail = "The object is not in a state that allows this."


class ExecutorUnreachable(DomainError):
    code = "executor_unreachable"
    status = 502
    default_detail = "The executor did not answer as expected."


class PayloadTooLarge(DomainError):
    code = "payload_too_large"
    status = 413
    default_detail = "Request body is too large."


class TryLater(DomainError):
    code = "try_later"
    status = 429
    default_detail = "The team's queue is full; try again later."

    def __init__(self, detail: str | None = None, *, retry_after: int, **extra: Any) -> None:
        super().__init__(detail, retry_after=retry_after, **extra)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class QuotaExceeded(DomainError):
    code = "quota_exceeded"
    status = 429
    default_detail = "The remaining budget cannot cover this request."


class FeatureDisabled(DomainError):
    code = "feature_disabled"
    status = 403
    default_detail = "This feature is switched off."
