"""Domain errors. Services raise these; views never build error responses themselves, the one
exception handler (telemachus/http/exception_handler.py) turns them into the API's JSON shape: a
machine-readable `error` code, a human `detail`, and sometimes more (per-field errors, reset_at)."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import IntegrityError


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
    """Bad input; `fields` maps each offending field to its messages (nested for nested input).
    The API's body keeps `detail` and `fields` apart; the exception's message joins them, so code
    that calls a service directly (a shell, governed_slot, a task) sees why in a traceback:
    `Invalid input. team: No team 'x' that you belong to.`"""

    code = "validation_error"
    default_detail = "Invalid input."

    def __init__(self, fields: dict[str, Any], detail: str | None = None) -> None:
        super().__init__(detail, fields=fields)
        self.fields = fields
        reasons = "; ".join(f"{path}: {message}" for path, message in _field_messages(fields))
        self.args = (f"{self.detail} {reasons}" if reasons else self.detail,)


class TeamNotFound(ValidationFailed):
    """A team that does not exist or that the caller is not in (the two read the same)."""

    def __init__(self, slug: str) -> None:
        super().__init__({"team": [f"No team {slug!r} that you belong to."]})
        self.slug = slug


class TeamRequired(ValidationFailed):
    """No team named, and the caller is in none or in several: which one is theirs to say."""

    def __init__(self, *, several: bool) -> None:
        where = "several teams" if several else "no team"
        super().__init__({"team": [f"You belong to {where}; name one."]})
        self.several = several


def _field_messages(fields: Any, path: str = "") -> list[tuple[str, str]]:
    """(dotted path, message) for every message in a fields map: values are messages, lists of
    them, or maps (and lists of maps, for list input) one level further down."""
    if isinstance(fields, dict):
        return [
            pair
            for key, value in fields.items()
            for pair in _field_messages(value, f"{path}.{key}" if path else str(key))
        ]
    if isinstance(fields, list | tuple):
        if any(isinstance(item, dict | list | tuple) for item in fields):
            return [pair for index, item in enumerate(fields) for pair in _field_messages(item, f"{path}[{index}]")]
        return [(path or "input", " ".join(str(message) for message in fields))]
    return [(path or "input", str(fields))]


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


class QueueDeadlineExceeded(TryLater):
    """A job waited for a slot longer than its caller would (requirements.max_queue_seconds, the
    /v1/ header X-Telemachus-Max-Queue-Seconds) and no model of its route could start it then."""

    code = "queue_deadline_exceeded"
    default_detail = "No slot was free within the job's queue deadline."


class QuotaExceeded(DomainError):
    code = "quota_exceeded"
    status = 429
    default_detail = "The remaining budget cannot cover this request."


class FeatureDisabled(DomainError):
    code = "feature_disabled"
    status = 403
    default_detail = "This feature is switched off."


def unique_violation(exc: IntegrityError) -> bool:
    """Whether the database refused a row for breaking a unique constraint (PostgreSQL's SQLSTATE
    23505, SQLite's "UNIQUE constraint failed"), as opposed to any other integrity error."""
    return getattr(exc.__cause__, "sqlstate", None) == "23505" or "UNIQUE constraint failed" in str(exc)


@contextmanager
def unique_or(error: DomainError) -> Iterator[None]:
    """A write whose check for an existing row raced an identical concurrent write: both saw no
    row, and the database's unique constraint refused the second insert (IntegrityError, a 500).
    That becomes `error`, the answer the check gives a request that comes a moment later. Wrap
    the whole atomic block, so the transaction is rolled back first."""
    try:
        yield
    except IntegrityError as exc:
        if not unique_violation(exc):
            raise
        raise error from None


def domain_error_from(body: dict[str, Any]) -> DomainError:
    """The domain error a stored refusal (`DomainError.body()`, kept with a job that ended
    refused: a budget spent while it waited) describes, to answer it as if raised now."""
    found: type[DomainError] = next((cls for cls in _kinds() if cls.code == body.get("error")), DomainError)
    extra = {name: value for name, value in body.items() if name not in ("error", "detail")}
    if found is ValidationFailed:
        return ValidationFailed(extra.get("fields") or {}, detail=body.get("detail"))
    return found(body.get("detail"), **extra)


def _kinds() -> list[type[DomainError]]:
    kinds, seen = [DomainError], 0
    while seen < len(kinds):
        kinds += kinds[seen].__subclasses__()
        seen += 1
    return kinds
