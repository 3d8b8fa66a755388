"""Traces (telemachus/tracing.py): off at no cost without an endpoint, and, with one, the job
submit's span continues the caller's W3C trace and reaches a real OTLP receiver (Arize Phoenix),
with the job keeping the context for its worker."""

import json
import secrets
import subprocess
import sys

import httpx
import pytest

from scheduler.models import Job
from tests.conftest import chat_body
from tests.credentials import token_for
from tests.phoenix import phoenix  # noqa: F401  (fixture)
from tests.processes import ROOT

OFF_CHECK = """
import json, os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
import telemachus.asgi  # the API server's start, which sets tracing up
from telemachus import tracing
print(json.dumps({
    "sdk_loaded": sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk")),
    "span_is_the_no_op": tracing.span("job.submit", attributes={"a": 1}) is tracing.NO_SPAN,
    "enabled": tracing.tracing_enabled(),
    "active": tracing.active,
    "carrier": tracing.trace_carrier(),
    "context": tracing.context_from_headers({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
}))
"""


def test_off_without_an_endpoint_loads_no_sdk_and_makes_no_span():
    """A fresh process, as the API server starts, with no OTLP endpoint in its environment."""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    env["OTEL_SERVICE_NAME"] = "telemachus-test"  # naming the service alone turns nothing on
    found = subprocess.run(
        [sys.executable, "-c", OFF_CHECK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(found.stdout.splitlines()[-1]) == {
        "sdk_loaded": [],
        "span_is_the_no_op": True,
        "enabled": False,
        "active": False,
        "carrier": {},
        "context": None,
    }


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def submit(base: str, token: str, header: str) -> dict:
    answer = httpx.post(
        f"{base}/api/jobs/",
        json=chat_body("a"),
        headers={"Authorization": f"Token {token}", "traceparent": header},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return answer.json()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_submit_continues_the_callers_trace(processes, phoenix, member_setup):  # noqa: F811
    alice, _, _, _, _ = member_setup
    token = token_for(alice)
    traced = processes.api_server(
        "traced", OTEL_EXPORTER_OTLP_ENDPOINT=phoenix.endpoint, OTEL_SERVICE_NAME="api", OTEL_BSP_SCHEDULE_DELAY="50"
    )
    untraced = processes.api_server("untraced", OTEL_SERVICE_NAME="api", OTEL_BSP_SCHEDULE_DELAY="50")

    # Given a caller inside its own trace, when it submits to the server that traces...
    trace_id, caller_span, header = traceparent()
    job = submit(traced, token, header)

    # Then the request's span is in Phoenix, in the caller's trace, a child of the caller's span,
    # and the submit's span a child of it.
    request, submit_span = sorted(phoenix.wait_for(trace_id, count=2), key=lambda s: s["start_time"])
    assert (request["name"], request["parent_id"]) == ("POST /api/jobs/", caller_span)
    assert request["attributes"]["http.response.status_code"] == 201
    assert (submit_span["name"], submit_span["parent_id"]) == ("job.submit", request["context"]["span_id"])
    attributes = submit_span["attributes"]
    assert (attributes["telemachus.job.id"], attributes["telemachus.job.type"]) == (job["id"], "chat")
    assert (attributes["telemachus.team"], attributes["gen_ai.request.model"]) == ("a", "m")
    # And the job keeps the submit span's context, for its worker's spans to join the trace.
    kept = Job.objects.get(pk=job["id"]).meta["trace"]["traceparent"]
    assert kept == f"00-{trace_id}-{submit_span['context']['span_id']}-01"

    # Given the same call to the server without an endpoint: no span, and the job keeps no context.
    off_trace, _, off_header = traceparent()
    quiet = submit(untraced, token, off_header)
    # (A later traced call arriving in Phoenix shows it has received what was sent before it.)
    later, _, later_header = traceparent()
    submit(traced, token, later_header)
    phoenix.wait_for(later)
    assert phoenix.spans(off_trace) == []
    assert "trace" not in Job.objects.get(pk=quiet["id"]).meta
