"""An OTLP/HTTP trace receiver in the test process: it decodes each export (protobuf, what the
OpenTelemetry SDK's exporter sends) and keeps its spans, links included, which Arize Phoenix's
REST API does not return. Start it with `OtlpReceiver()` and point a process at `.endpoint` with
OTEL_EXPORTER_OTLP_ENDPOINT."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.processes import wait_until


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                export = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["content-length"])))
                with receiver.lock:
                    receiver.spans += [
                        _span(span, resource.resource)
                        for resource in export.resource_spans
                        for scope in resource.scope_spans
                        for span in scope.spans
                    ]
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list[dict]:
        with self.lock:
            return [span for span in self.spans if span["name"] == name]

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [span for span in self.spans if span["trace_id"] == trace_id]

    def wait_for(self, predicate, *, what: str, timeout: float = 60):
        return wait_until(lambda: predicate(self), timeout=timeout, interval=0.1, what=what)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _span(span, resource) -> dict:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_id": span.parent_span_id.hex() or None,
        "links": [{"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links],
        "attributes": {kv.key: _value(kv.value) for kv in span.attributes},
        "status": span.status.code,
        "service": next((_value(kv.value) for kv in resource.attributes if kv.key == "service.name"), None),
    }


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None
