"""A model server that misbehaves on purpose, for tests of the HTTP drivers, retries and breaker.

The first path segment picks the behaviour of `POST /<mode>/v1/chat/completions`:

    ok          a normal completion          500 / 502 / 503   that status, OpenAI-style error
    429         429 with Retry-After: 1      400 / 401 / 403   that status (not retryable)
    404model     404 "model does not exist"   hang              never answers (past any timeout)
    malformed   200 with a body that is not JSON
    reset       starts an SSE stream, then drops the connection mid-stream
    nousage     a well-formed SSE stream whose chunks carry no usage (the driver must count)
    bigline     an SSE stream, CRLF line ends, whose one content chunk is a 400 KB line
    nan         a completion with NaN in it (Python's json accepts it; JSON and databases do not)
    nul         a completion whose text holds a NUL character (PostgreSQL's jsonb cannot store it)
    auth        200 only with `Authorization: Bearer $FAULT_EXPECTED_KEY`, else 401 echoing the header
    switch      fails with 503 while the switch is on (POST /switch/on, /switch/off; starts on)

`GET /<mode>/v1/models` always answers 200 (the breaker is passive: probes do not feed it), after 0.5 s
in mode `slow`. `GET /stats` counts requests per mode. Run: python -m tests.executors.faultserver --port P
"""

import argparse
import asyncio
import json
import os
from collections import Counter
from typing import Any

import uvicorn

from executors.simllm import error_body, lifespan, read_json, respond

MODEL = "m"


class FaultServer:
    def __init__(self) -> None:
        self.requests: Counter = Counter()
        self.switch_on = True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        path = scope["path"].strip("/").split("/")
        if path == ["stats"]:
            return await respond(send, 200, dict(self.requests))
        if path[0] == "switch" and len(path) == 2 and path[1] in ("on", "off"):
            self.switch_on = path[1] == "on"
            return await respond(send, 200, {"on": self.switch_on})
        mode, rest = path[0], "/".join(path[1:])
        if rest == "v1/models":
            if mode == "slow":
                await asyncio.sleep(0.5)
            return await respond(send, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if rest != "v1/chat/completions":
            return await respond(send, 404, error_body("no such route", "not_found"))
        self.requests[mode] += 1
        body = await read_json(receive)
        headers = dict(scope["headers"])
        await self.chat(mode, body, headers, send)

    async def chat(self, mode: str, body: Any, headers: dict[bytes, bytes], send: Any) -> None:
        if mode in ("500", "502", "503", "400", "401", "403"):
            return await respond(send, int(mode), error_body(f"upstream says {mode}", "error"))
        if mode == "switch" and self.switch_on:
            return await respond(send, 503, error_body("switched off", "server_error"))
        if mode == "429":
            payload = json.dumps(error_body("slow down", "rate_limit")).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 429,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
                }
            )
            return await send({"type": "http.response.body", "body": payload})
        if mode == "404model":
            return await respond(
                send, 404, error_body(f"The model '{body.get('model')}' does not exist", "model_not_found")
            )
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "malformed":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            return await send({"type": "http.response.body", "body": b'{"choices": [{"message": '})
        if mode == "reset":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            chunk = {"choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}]}
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True}
            )
            raise ConnectionResetError("dropping the connection mid-stream, on purpose")
        if mode == "nan":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            body = b'{"choices": [{"message": {"role": "assistant", "content": "x"}}], "usage": {"prompt_tokens": NaN}}'
            return await send({"type": "http.response.body", "body": body})
        if mode == "nul":
            return await respond(
                send,
                200,
                {
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "bad\u0000byte"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                },
            )
        if mode == "nousage":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for word in ("one", " two", " three"):
                chunk = {"model": MODEL, "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                await send(
                    {"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True}
                )
            return await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        if mode == "bigline":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            chunk = {"model": MODEL, "choices": [{"index": 0, "delta": {"content": "x" * 400_000}}]}
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\r\n\r\n".encode(), "more_body": True}
            )
            return await send({"type": "http.response.body", "body": b"data: [DONE]\r\n\r\n"})
        if mode == "auth":
            expected = f"Bearer {os.environ.get('FAULT_EXPECTED_KEY', '')}".encode()
            got = headers.get(b"authorization", b"")
            if got != expected:
                return await respond(send, 401, error_body(f"invalid credentials: {got.decode()}", "invalid_api_key"))
        await respond(
            send,
            200,
            {
                "id": "chatcmpl-fault",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"ok from {mode}"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            },
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(FaultServer(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
