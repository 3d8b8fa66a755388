"""A local OTLP/HTTP receiver that keeps nothing: the other end of bench/gateway.py --tracing, so
that what is measured is what tracing costs the process that traces, not a backend's work on the
same cores. It answers every export at once (200, an empty ExportTraceServiceResponse) and counts
the exports and their bytes, readable at GET /stats.

    python bench/otlpsink.py PORT
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

received = {"exports": 0, "bytes": 0}


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        received["exports"] += 1
        received["bytes"] += len(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        payload = json.dumps(received).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        return None


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink).serve_forever()
