"""A webhook receiver for the tests, run as a process of its own (`python -m
tests.telemachus.webhooks.receiver --port N`), as a team's would be: it verifies each delivery's
signature with the `standardwebhooks` package under the secret the test hands it, and answers as
told, failing the first attempts of each message on purpose or answering late.

  POST /_control  {"secret": "whsec_...", "fail_first": N, "delay": seconds}: how to answer from now
  GET  /_received {"accepted": [{"id", "type", "data", "attempt"}], "attempts": {id: n}, "rejected": n}
  POST anything else: a delivery
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

state = {"secret": None, "fail_first": 0, "delay": 0.0, "accepted": [], "attempts": {}, "rejected": 0}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        with lock:
            self._answer(200, {k: state[k] for k in ("accepted", "attempts", "rejected")})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/_control":
            with lock:
                state.update(json.loads(body))
            self._answer(200, {"ok": True})
            return
        message_id = self.headers.get("webhook-id", "")
        with lock:
            attempt = state["attempts"][message_id] = state["attempts"].get(message_id, 0) + 1
            secret, fail_first, delay = state["secret"], state["fail_first"], state["delay"]
        if delay:
            time.sleep(delay)
        if attempt <= fail_first:
            self._answer(500, {"error": f"failing attempt {attempt} on purpose"})
            return
        try:
            payload = Webhook(secret).verify(body, dict(self.headers))
        except (WebhookVerificationError, TypeError, ValueError) as exc:
            with lock:
                state["rejected"] += 1
            self._answer(401, {"error": f"signature refused: {exc}"})
            return
        with lock:
            state["accepted"].append(
                {"id": message_id, "type": payload["type"], "data": payload["data"], "attempt": attempt}
            )
        self._answer(200, {"ok": True, "received": message_id})

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
