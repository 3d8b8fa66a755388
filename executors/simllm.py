"""simllm: a simulated model server that speaks the OpenAI-compatible HTTP API.

It serves `/v1/chat/completions` (plain and streamed as SSE), `/v1/embeddings` and `/v1/models` for
demos, for tests of the real HTTP drivers, and for capacity planning against a simulated fleet.
Replies are labelled as simulated, and deterministic where a test needs them to be: given `tools`,
a reply calls them by the rules of executors/simtools.py; after a `tool` message a text reply says
what the tool said; the same text always embeds to the same vector. It counts its own concurrent
requests so tests can check that the scheduler's caps hold on the wire: `GET /stats` reports
in-flight and peak counts in total and per path prefix (one server can stand in for several
executors: `http://127.0.0.1:P/e1/v1` and `.../e2/v1` are counted apart), and requests per job (the
`X-Telemachus-Job` header the drivers send), so a test can count one flow's model calls among
others'; `POST /stats/reset` zeroes them. Given an API key (`--api-key`, or SIMLLM_API_KEY), it
answers 401 `invalid_api_key` to every /v1/ request without `Authorization: Bearer <key>`, as
vLLM's `--api-key` does (or, with `--api-key-header NAME`, without the key in that header, as
Azure's `api-key`).

A raw ASGI app (no framework) served by uvicorn: `python manage.py simllm --port P`.
"""

import asyncio
import base64
import hmac
import json
import random
import struct
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from executors.simtools import sim_tool_calls
from executors.tokens import count_prompt_tokens, embedding_inputs, simulated_embedding

Scope = dict[str, Any]
# A streamed tool call's arguments go out in pieces of this many characters, one a token's time.
TOOL_PIECE_CHARS = 8


@dataclass
class Stats:
    in_flight: Counter = field(default_factory=Counter)
    peak: Counter = field(default_factory=Counter)
    requests: Counter = field(default_factory=Counter)
    disconnects: Counter = field(default_factory=Counter)
    jobs: Counter = field(default_factory=Counter)
    total_in_flight: int = 0
    total_peak: int = 0
    total_requests: int = 0

    def enter(self, prefix: str, job: str | None = None) -> None:
        if job:
            self.jobs[job] += 1
        self.in_flight[prefix] += 1
        self.peak[prefix] = max(self.peak[prefix], self.in_flight[prefix])
        self.requests[prefix] += 1
        self.total_in_flight += 1
        self.total_peak = max(self.total_peak, self.total_in_flight)
        self.total_requests += 1

    def leave(self, prefix: str) -> None:
        self.in_flight[prefix] -= 1
        self.total_in_flight -= 1

    def as_json(self) -> dict[str, Any]:
        return {
            "in_flight": self.total_in_flight,
            "peak": self.total_peak,
            "requests": self.total_requests,
            "disconnects": sum(self.disconnects.values()),
            "jobs": dict(self.jobs),
            "prefixes": {
                p: {
                    "in_flight": self.in_flight[p],
                    "peak": self.peak[p],
                    "requests": self.requests[p],
                    "disconnects": self.disconnects[p],
                }
                for p in sorted(self.requests)
            },
        }


class SimLLM:
    def __init__(
        self,
        *,
        models: list[str],
        latency_ms: float = 50,
        tokens_per_s: float = 0,
        fail_rate: float = 0,
        output_tokens: int = 16,
        api_key: str | None = None,
        api_key_header: str = "authorization",
    ) -> None:
        self.models = models
        self.api_key = api_key
        self.api_key_header = api_key_header.lower()
        self.latency = latency_ms / 1000
        self.tokens_per_s = tokens_per_s
        self.fail_rate = fail_rate
        self.output_tokens = output_tokens
        self.stats = Stats()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path == "/stats" and method == "GET":
            return await respond(send, 200, self.stats.as_json())
        if path == "/stats/reset" and method == "POST":
            self.stats = Stats()
            return await respond(send, 200, {"reset": True})
        if "/v1/" in path and not self.authorized(scope):
            return await respond(send, 401, error_body("Incorrect API key provided.", "invalid_api_key"))
        if path.endswith("/v1/models") and method == "GET":
            return await respond(
                send,
                200,
                {
                    "object": "list",
                    "data": [{"id": m, "object": "model", "created": 0, "owned_by": "simllm"} for m in self.models],
                },
            )
        for route, handler in (("/v1/chat/completions", self.chat), ("/v1/embeddings", self.embeddings)):
            if path.endswith(route) and method == "POST":
                prefix = path[: -len(route)].strip("/")
                self.stats.enter(prefix, header(scope, b"x-telemachus-job"))
                body = await read_json(receive)
                gone = asyncio.ensure_future(wait_for_disconnect(receive))
                try:
                    return await handler(send, body, gone)
                except ClientGone:
                    self.stats.disconnects[prefix] += 1
                    return
                finally:
                    gone.cancel()
                    self.stats.leave(prefix)
        return await respond(send, 404, error_body(f"no route for {method} {path}", "not_found"))

    def authorized(self, scope: Scope) -> bool:
        """Whether the request carries the server's API key (any request, when it has none)."""
        if not self.api_key:
            return True
        expected = f"Bearer {self.api_key}" if self.api_key_header == "authorization" else self.api_key
        sent = header(scope, self.api_key_header.encode("latin-1")) or ""
        return hmac.compare_digest(sent.encode("latin-1", "replace"), expected.encode("latin-1", "replace"))

    async def embeddings(self, send: Any, body: Any, gone: asyncio.Future) -> None:
        if not isinstance(body, dict) or not embedding_inputs(body.get("input")):
            return await respond(send, 400, error_body("'input' must be a string or a list", "invalid_request_error"))
        model = body.get("model")
        if model not in self.models:
            return await respond(send, 404, error_body(f"The model '{model}' does not exist", "model_not_found"))
        await pause(self.latency, gone)
        texts = embedding_inputs(body["input"])
        dims = int(body.get("dimensions") or 16)
        data = []
        for index, text in enumerate(texts):
            vector: Any = simulated_embedding(text, dims)
            if body.get("encoding_format") == "base64":
                vector = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        tokens = sum(len(text.split()) for text in texts)
        await respond(
            send,
            200,
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    async def chat(self, send: Any, body: Any, gone: asyncio.Future) -> None:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return await respond(send, 400, error_body("'messages' must be a list", "invalid_request_error"))
        model = body.get("model")
        if model not in self.models:
            return await respond(send, 404, error_body(f"The model '{model}' does not exist", "model_not_found"))
        completion = min(self.output_tokens, int(body.get("max_tokens") or self.output_tokens))
        prompt = count_prompt_tokens(body["messages"])
        await pause(self.latency, gone)
        if random.random() < self.fail_rate:
            return await respond(send, 500, error_body("simulated server failure (simllm --fail-rate)", "server_error"))
        words = [f"sim{i}" for i in range(completion)]
        created, ident = int(time.time()), f"chatcmpl-{uuid.uuid4().hex[:24]}"
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        calls = sim_tool_calls(body["messages"], body.get("tools"), body.get("tool_choice", "auto"))
        if body.get("stream"):
            return await self.stream(send, ident, created, model, words, usage, body, gone, calls)
        await pause(completion / self.tokens_per_s if self.tokens_per_s else 0, gone)
        if calls:
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls"
        else:
            message = {"role": "assistant", "content": reply_prefix(body) + " ".join(words)}
            finish = "length" if completion == body.get("max_tokens") else "stop"
        await respond(
            send,
            200,
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage,
                "system_fingerprint": "simllm",
            },
        )

    async def stream(
        self,
        send: Any,
        ident: str,
        created: int,
        model: str,
        words: list[str],
        usage: dict[str, int],
        body: dict[str, Any],
        gone: asyncio.Future,
        calls: list[dict[str, Any]],
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )

        async def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
            chunk = {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True}
            )

        include_usage = (body.get("stream_options") or {}).get("include_usage")
        per_token = 1 / self.tokens_per_s if self.tokens_per_s else 0
        if calls:
            # OpenAI streams a tool call as deltas of an indexed entry: id and name first, then
            # the arguments text in pieces, a token's time apart (a piece per few characters).
            await event({"role": "assistant", "content": None})
            for index, call in enumerate(calls):
                function = call["function"]
                arguments = function["arguments"]
                await event(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call["id"],
                                "type": "function",
                                "function": {"name": function["name"], "arguments": ""},
                            }
                        ]
                    }
                )
                for start in range(0, len(arguments), TOOL_PIECE_CHARS):
                    await pause(per_token, gone)
                    piece = arguments[start : start + TOOL_PIECE_CHARS]
                    await event({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            await event({}, "tool_calls", **({"usage": usage} if include_usage else {}))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return
        await event({"role": "assistant", "content": reply_prefix(body).rstrip()})
        for word in words:
            await pause(per_token, gone)
            await event({"content": " " + word})
        await event({}, "stop", **({"usage": usage} if include_usage else {}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def reply_prefix(body: dict[str, Any]) -> str:
    """The label of a text reply; after a tool's result, also what the tool said."""
    messages = body.get("messages") or []
    if messages and messages[-1].get("role") == "tool":
        return f"[simulated by simllm] the tool said: {str(messages[-1].get('content') or '')[:200]} "
    return "[simulated by simllm] "


async def lifespan(receive: Any, send: Any) -> None:
    """ASGI lifespan: nothing to set up or tear down, but say so."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class ClientGone(Exception):
    """The client closed the connection (a canceled job): stop generating."""


async def wait_for_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def pause(seconds: float, gone: asyncio.Future) -> None:
    """Sleep like a model thinking, but stop at once if the client hangs up."""
    if gone.done():
        raise ClientGone
    if seconds <= 0:
        return
    await asyncio.wait([gone], timeout=seconds)
    if gone.done():
        raise ClientGone


def header(scope: Scope, name: bytes) -> str | None:
    """A request header's value (`name` in lower case), if sent."""
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return None


def error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": kind}}


async def read_json(receive: Any) -> Any:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    try:
        return json.loads(b"".join(chunks) or b"null")
    except ValueError:
        return None


async def respond(send: Any, status: int, body: Any) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})
