"""The gateway's errors: `GatewayError`, an error answered in the caller's protocol, OpenAI's shape
`{"error": {"message", "type", "param", "code"}}` by default (each dialect renders it its own way:
scheduler/gateway/dialect.py), with the status codes the SDKs map to their exceptions; and the
errors every protocol shares: a bad request, no credentials, the API's domain errors, a job that
ended without an answer, a path or method the gateway does not serve."""

import math
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from scheduler.gateway.asgi import Request
from scheduler.models import Job
from telemachus import errors

TEAM_HEADER = "x-telemachus-team"


class GatewayError(Exception):
    """An error answered in the caller's protocol (OpenAI's shape unless its dialect renders it
    otherwise). `retry` False adds `x-should-retry: false`, which OpenAI's SDKs obey instead of
    retrying on their own (they retry 409, 429 and 5xx by default)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = dict(headers or {})
        if retry is False:
            self.headers["x-should-retry"] = "false"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, code="invalid_request", param=param)


def not_authenticated(*, api_key_header: str | None = None, refusal: str | None = None) -> GatewayError:
    """401 in the words of the protocol's own credential header (`api_key_header`, e.g. Anthropic's
    x-api-key; else Authorization: Bearer), saying why a credential was refused (`refusal`: revoked,
    expired...) when one came."""
    how = f"{api_key_header}: <key>" if api_key_header else "Authorization: Bearer <key>"
    what = refusal or "Missing or invalid API key."
    return GatewayError(401, f"{what} Send a live Telemachus API key as {how}.", code="invalid_api_key")


def from_domain(exc: errors.DomainError) -> GatewayError:
    """The API's domain errors (submit's checks) as the gateway answers them."""
    if isinstance(exc, errors.UnknownModel):
        return GatewayError(404, exc.detail, code="model_not_found", param="model")
    if isinstance(exc, errors.QueueDeadlineExceeded):
        return GatewayError(
            429,
            exc.detail,
            type="rate_limit_error",
            code=exc.code,
            headers={"retry-after": str(exc.retry_after)},
            retry=False,
        )
    if isinstance(exc, errors.TryLater):
        return GatewayError(
            429, exc.detail, type="rate_limit_error", code="try_later", headers={"retry-after": str(exc.retry_after)}
        )
    if isinstance(exc, errors.QuotaExceeded):
        wait = _seconds_until(exc.extra.get("reset_at"))
        # Past a minute the SDKs ignore Retry-After and retry within seconds: pointless for a budget.
        return GatewayError(
            429,
            exc.detail,
            type="insufficient_quota",
            code="quota_exceeded",
            headers={"retry-after": str(wait)},
            retry=wait <= 60,
        )
    if isinstance(exc, errors.TeamNotFound):
        message = f"No team {exc.slug!r} that you belong to."
        return GatewayError(404, message, code="team_not_found", param=TEAM_HEADER, retry=False)
    if isinstance(exc, errors.TeamRequired):
        where = "several teams" if exc.several else "no team"
        message = f"You belong to {where}; name one with the X-Telemachus-Team header."
        return GatewayError(400, message, code="team_required", param=TEAM_HEADER, retry=False)
    if isinstance(exc, errors.ValidationFailed):
        fields = exc.extra.get("fields") or {}
        param = next(iter(fields), None)
        detail = "; ".join(f"{name}: {' '.join(map(str, _flat(msgs)))}" for name, msgs in fields.items())
        return bad_request(detail or exc.detail, param)
    if isinstance(exc, errors.Forbidden):
        return GatewayError(403, exc.detail, type="permission_error", code="forbidden", retry=False)
    if isinstance(exc, errors.NotFound):
        return GatewayError(404, exc.detail, code="not_found", retry=False)
    return GatewayError(exc.status, exc.detail, code=exc.code, retry=False)


def _seconds_until(stamp: Any) -> int:
    when = parse_datetime(str(stamp)) if stamp else None
    if when is None:
        return 60
    return max(1, math.ceil((when - timezone.now()).total_seconds()))


def _flat(messages: Any) -> list[Any]:
    if isinstance(messages, dict):
        return [f"{k}: {' '.join(map(str, _flat(v)))}" for k, v in messages.items()]
    return list(messages) if isinstance(messages, list | tuple) else [messages]


def job_failure(*, status: str, error: str, upstream_status: int | None, timed_out: bool) -> GatewayError:
    """A job that ended without an answer: failed after its retries (502, or 504 when the model
    server did not answer in time; the model server's own 4xx passes through), or canceled. The
    scheduler has retried already, so the SDK is told not to."""
    if status == Job.Status.CANCELED:
        return GatewayError(409, "The job was canceled before it finished.", code="job_canceled", retry=False)
    if timed_out or upstream_status in (408, 504):
        return GatewayError(
            504,
            error or "The model server did not answer in time.",
            type="api_error",
            code="executor_timeout",
            retry=False,
        )
    if upstream_status and 400 <= upstream_status < 500 and upstream_status != 429:
        return GatewayError(upstream_status, error, code="model_server_rejected", retry=False)
    return GatewayError(502, error or "The model server failed.", type="api_error", code="executor_error", retry=False)


def unknown_url(request: Request, *, retry: bool | None = False) -> GatewayError:
    return GatewayError(404, f"Unknown path: {request.method} {request.path}", code="unknown_url", retry=retry)


def method_not_allowed(request: Request, method: str, *, retry: bool | None = False) -> GatewayError:
    return GatewayError(
        405, f"{request.method} is not allowed on {request.path}; use {method}.", code="method_not_allowed", retry=retry
    )


INTERRUPTED = GatewayError(
    502,
    "The model's stream broke off after part of the answer was sent, and the job was retried; "
    "its answer can no longer be relayed in order.",
    type="api_error",
    code="stream_interrupted",
    retry=False,
)
