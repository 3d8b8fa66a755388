"""The gateway's errors (scheduler/gateway/errors.py): the API's domain errors and a job that
ended without an answer, as the SDKs are told of them."""

from datetime import timedelta

import pytest
from django.utils import timezone

from scheduler.gateway.errors import from_domain, job_failure
from telemachus import errors


class TestErrors:
    def test_domain_errors_in_openai_shape(self):
        unknown = from_domain(errors.UnknownModel("no such model", model="x"))
        assert (unknown.status, unknown.code, unknown.param) == (404, "model_not_found", "model")
        assert unknown.body() == {
            "error": {
                "message": "no such model",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        later = from_domain(errors.TryLater("queue full", retry_after=7))
        assert (later.status, later.code, later.headers) == (429, "try_later", {"retry-after": "7"})
        invalid = from_domain(errors.ValidationFailed({"priority": ["At most 5."]}))
        assert (invalid.status, invalid.param, invalid.message) == (400, "priority", "priority: At most 5.")

    def test_a_budget_that_resets_soon_may_be_retried_and_one_that_resets_later_may_not(self):
        soon = timezone.now() + timedelta(seconds=30)
        later = timezone.now() + timedelta(hours=5)
        retry = from_domain(errors.QuotaExceeded("spent", reset_at=soon.isoformat()))
        wait = from_domain(errors.QuotaExceeded("spent", reset_at=later.isoformat()))
        assert (
            retry.status == 429
            and 25 <= int(retry.headers["retry-after"]) <= 31
            and "x-should-retry" not in retry.headers
        )
        assert int(wait.headers["retry-after"]) > 3600 and wait.headers["x-should-retry"] == "false"

    @pytest.mark.parametrize(
        "status, upstream, timed_out, expected",
        [
            ("failed", 502, False, (502, "executor_error")),
            ("failed", None, True, (504, "executor_timeout")),
            ("failed", 504, False, (504, "executor_timeout")),
            ("failed", 400, False, (400, "model_server_rejected")),
            ("failed", 429, False, (502, "executor_error")),
            ("canceled", None, False, (409, "job_canceled")),
        ],
    )
    def test_how_a_job_that_did_not_answer_is_told(self, status, upstream, timed_out, expected):
        failure = job_failure(status=status, error="boom", upstream_status=upstream, timed_out=timed_out)
        assert (failure.status, failure.code) == expected and failure.headers["x-should-retry"] == "false"
