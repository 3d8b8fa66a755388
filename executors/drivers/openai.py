"""Drivers for model servers that speak the OpenAI-compatible HTTP API (Ollama, vLLM, llama.cpp's
server, LM Studio, hosted providers).

`endpoint` is the API base including its version prefix, for example http://127.0.0.1:11434/v1;
a chat step is `POST {endpoint}/chat/completions`, an embeddings step (`requirements.api` =
`embeddings`) `POST {endpoint}/embeddings`, discovery and probes `GET {endpoint}/models`.
A job's `tools` (OpenAI function schemas; a flow's are built from the tool registry) go to the
server as they are, and the reply's `tool_calls` come back in the result's `message`. Each request
names its job in an `X-Telemachus-Job` header, for the server's logs (simllm counts by it).
`transport` may set `timeout_s` (default 120: the longest silence while waiting for the server's
bytes, so a long stream is never cut while it flows), `connect_timeout_s` (default 5) and the
credentials the server wants (executors/credentials.py): `api_key` or `api_key_env`, sent as
`Authorization: Bearer`, and `headers`, each stored sealed or read from the environment, resolved
each time a session is built (so an environment variable rotates with no database change), and
redacted from every error. `remote-model` requires one. No secret is returned by the API, written
to events or logged.

The HTTP client is aiohttp's: one session (one keep-alive connection pool, no limit of its own:
the executor's slots bound its concurrency) per driver, per event loop. It costs about a quarter
of httpx's CPU per request (0.25-0.31 ms against 1.14-1.39 ms for a chat completion to a local
server, measured on this project's 2-vCPU machine), and in the one-hop gateway the API process
makes the model call itself, so that CPU is the call's latency. Proxies from the environment
(HTTP_PROXY) are not used: model servers are reached directly."""

import json
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import aiohttp

from executors.contract import (
    EMBEDDINGS_API,
    DispatchError,
    DispatchRequest,
    DispatchResult,
    ExecutorDriver,
    Probe,
    StreamEvent,
)
from executors.credentials import SecretUnavailable, transport_has_credentials, transport_headers
from executors.models import Executor
from executors.tokens import count_prompt_tokens

# Request options a job may pass through to the model server, beside model and messages.
PASSTHROUGH_OPTIONS = (
    "max_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "user",
)
EMBEDDING_OPTIONS = ("encoding_format", "dimensions", "user")
# Worth another attempt (maybe elsewhere): overload and gateway errors. 4xx otherwise is the
# request's fault (bad request, bad key, unknown model) and fails the job at once.
RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
# Slower than this to answer a probe is `degraded`.
SLOW_PROBE_MS = 2000
# The longest line of a server's stream (one SSE event): aiohttp refuses a line longer than twice
# its read buffer, 128 KiB by default, and one chunk can carry a whole tool call's arguments.
READ_BUFFER_BYTES = 1 << 20
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


def strict_json(text: str | bytes) -> Any:
    """JSON as servers should send it: NaN and Infinity, which Python accepts and the database's
    JSON does not, are malformed, and so is a number that overflows to infinity (`1e999`)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"{literal} is out of range")
        return value

    return json.loads(text, parse_constant=refuse, parse_float=finite)


@dataclass(frozen=True)
class Answer:
    """A model server's whole answer, read before the connection went back to the pool."""

    status: int
    reason: str
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class LocalModelDriver(ExecutorDriver):
    kind = "local-model"

    def __init__(self, executor: Executor) -> None:
        super().__init__(executor)
        self._session: aiohttp.ClientSession | None = None
        self._base = (executor.endpoint or "").rstrip("/")

    # --- configuration --------------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        """The transport's credentials as headers (executors/credentials.py), resolved now: a
        sealed one unsealed, an environment variable read. One this process cannot produce fails
        the dispatch without a retry (another attempt here would fail alike)."""
        try:
            return transport_headers(self.executor.transport or {}, executor=self.executor.name)
        except SecretUnavailable as exc:
            raise DispatchError(str(exc), retryable=False) from None

    def secrets(self) -> list[str]:
        """Strings that must never appear in an error message: each credential header's value (a
        Bearer's or Basic's without its scheme), longest first."""
        try:
            values = transport_headers(self.executor.transport or {}, executor=self.executor.name).values()
        except SecretUnavailable:
            return []
        found = {value.partition(" ")[2] if value.startswith(("Bearer ", "Basic ")) else value for value in values}
        return sorted(found - {""}, key=len, reverse=True)

    def session(self) -> aiohttp.ClientSession:
        """This executor's session (per worker process), made on first use so it binds to the
        worker's event loop. Concurrency is bounded by slots, not by the pool, and every
        connection it opens is kept alive for the next request."""
        if self._session is None or self._session.closed:
            transport = self.executor.transport or {}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=float(transport.get("connect_timeout_s", 5)),
                    sock_read=float(transport.get("timeout_s", 120)),
                ),
                headers=self.headers(),
                json_serialize=partial(json.dumps, ensure_ascii=False, separators=(",", ":"), allow_nan=False),
                read_bufsize=READ_BUFFER_BYTES,
            )
        return self._session

    async def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> Answer:
        """One request, its whole answer read; a transport failure as the DispatchError it is."""
        try:
            async with self.session().request(method, self._base + path, json=body, headers=headers) as response:
                content = await response.read()
                return Answer(response.status, response.reason or "", response.headers, content)
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from exc

    def request_body(self, request: DispatchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": request.model, "messages": request.input.get("messages") or []}
        body.update({k: request.input[k] for k in PASSTHROUGH_OPTIONS if k in request.input})
        return body

    # --- dispatch -------------------------------------------------------------------------------

    async def dispatch(self, request: DispatchRequest) -> DispatchResult:
        self._require_endpoint()
        embeddings = request.api == EMBEDDINGS_API
        if embeddings:
            path = "/embeddings"
            body = {"model": request.model, "input": request.input.get("input")}
            body.update({k: request.input[k] for k in EMBEDDING_OPTIONS if k in request.input})
        else:
            path, body = "/chat/completions", self.request_body(request)
        response = await self._call("POST", path, body, job_header(request))
        if response.status >= 400:
            raise self._status_error(response, upstream_message(response))
        return self._parse_embeddings(response) if embeddings else self._parse_completion(response)

    async def stream(self, request: DispatchRequest) -> AsyncIterator[StreamEvent]:
        """Relay the server's SSE stream: its text and its tool calls' pieces as they come. Usage
        comes from the final chunk when the server sends it (we ask with
        stream_options.include_usage); otherwise it is counted: one token per content delta, the
        prompt as the sim tokenizer counts it."""
        self._require_endpoint()
        body = {**self.request_body(request), "stream": True, "stream_options": {"include_usage": True}}
        content, deltas, usage, finish, model = [], 0, None, None, None
        tool_calls: dict[int, dict[str, Any]] = {}
        try:
            async with self.session().post(
                self._base + "/chat/completions", json=body, headers=job_header(request)
            ) as response:
                if response.status >= 400:
                    answer = Answer(response.status, response.reason or "", response.headers, await response.read())
                    raise self._status_error(answer, upstream_message(answer))
                async for raw in response.content:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = self._parse_chunk(data)
                    model = chunk.get("model") or model
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        finish = choice.get("finish_reason") or finish
                        delta = choice.get("delta") or {}
                        for call in delta.get("tool_calls") or ():
                            index, merged = _merge_tool_call(tool_calls, call)
                            function = merged["function"]
                            yield StreamEvent(
                                kind="tool",
                                index=index,
                                id=merged["id"] or "",
                                name=function["name"],
                                text=(call.get("function") or {}).get("arguments") or "",
                            )
                        text = delta.get("content")
                        if text:
                            content.append(text)
                            deltas += 1
                            yield StreamEvent(kind="delta", text=text)
                else:
                    raise DispatchError(f"{self.executor.name}: stream ended before [DONE]", retryable=True)
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from exc
        except ValueError as exc:  # a line longer than the read buffer
            raise DispatchError(
                f"{self.executor.name}: malformed stream ({exc})", retryable=True, executor_fault=True
            ) from exc
        prompt_tokens = int(usage["prompt_tokens"]) if usage else count_prompt_tokens(body["messages"])
        completion_tokens = int(usage["completion_tokens"]) if usage else deltas
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if tool_calls:
            message = {
                "role": "assistant",
                "content": message["content"] or None,
                "tool_calls": [tool_calls[index] for index in sorted(tool_calls)],
            }
        yield StreamEvent(
            kind="done",
            result=DispatchResult(
                output={
                    "model": model,
                    "message": message,
                    "finish_reason": finish,
                    "streamed": True,
                    "usage_counted": usage is None,
                },
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
            ),
        )

    # --- discovery and health -------------------------------------------------------------------

    async def list_models(self) -> list[str]:
        """The model ids the server reports at GET {endpoint}/models."""
        self._require_endpoint()
        response = await self._call("GET", "/models")
        if response.status >= 400:
            raise self._status_error(response, upstream_message(response))
        try:
            return [str(item["id"]) for item in strict_json(response.content)["data"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise DispatchError(f"{self.executor.name}: malformed model list", retryable=False) from exc

    async def probe(self) -> Probe:
        """ok: answers /models quickly and serves every model it is configured with; degraded: slow,
        or some configured models are missing; down: no answer or an error."""
        started = time.perf_counter()
        try:
            served = await self.list_models()
        except DispatchError as exc:
            return Probe(health=Executor.Health.DOWN, detail=str(exc))
        latency = (time.perf_counter() - started) * 1000
        missing = sorted(set(self.executor.offered_models) - set(served))
        if missing:
            return Probe(
                health=Executor.Health.DEGRADED,
                latency_ms=latency,
                models=served,
                detail=f"configured models not served: {', '.join(missing)}",
            )
        if latency > SLOW_PROBE_MS:
            return Probe(
                health=Executor.Health.DEGRADED, latency_ms=latency, models=served, detail=f"slow: {latency:.0f} ms"
            )
        return Probe(health=Executor.Health.OK, latency_ms=latency, models=served)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    # --- errors ---------------------------------------------------------------------------------

    def _require_endpoint(self) -> None:
        if not self.executor.endpoint:
            raise DispatchError(f"executor {self.executor.name} has no endpoint", retryable=False)

    def _redact(self, text: str) -> str:
        for secret in self.secrets():
            text = text.replace(secret, "***")
        return text

    def _transport_error(self, exc: BaseException) -> DispatchError:
        timed_out = isinstance(exc, TimeoutError)
        detail = self._redact(f"{type(exc).__name__}: {exc}".rstrip(": "))
        return DispatchError(
            f"{self.executor.name} {'timed out' if timed_out else 'unreachable'} ({detail})",
            retryable=True,
            executor_fault=True,
            timed_out=timed_out,
        )

    def _status_error(self, response: Answer, message: str) -> DispatchError:
        return DispatchError(
            self._redact(f"{self.executor.name} answered {response.status}: {message}"),
            retryable=response.status in RETRYABLE_STATUS,
            status=response.status,
            retry_after=retry_after(response),
            executor_fault=response.status >= 500,
        )

    def _parse_chunk(self, data: str) -> dict[str, Any]:
        try:
            chunk = strict_json(data)
        except ValueError as exc:
            raise DispatchError(
                f"{self.executor.name}: malformed stream chunk {data[:100]!r}", retryable=True, executor_fault=True
            ) from exc
        if not isinstance(chunk, dict):
            raise DispatchError(
                f"{self.executor.name}: malformed stream chunk {data[:100]!r}", retryable=True, executor_fault=True
            )
        return chunk

    def _parse_completion(self, response: Answer) -> DispatchResult:
        try:
            data = strict_json(response.content)
            choice = data["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise DispatchError(
                f"{self.executor.name}: malformed completion {response.text[:200]!r}",
                retryable=True,
                executor_fault=True,
            ) from exc
        usage = data.get("usage") or {}
        return DispatchResult(
            output={
                "model": data.get("model"),
                "id": data.get("id"),
                "message": message,
                "finish_reason": choice.get("finish_reason"),
            },
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )

    def _parse_embeddings(self, response: Answer) -> DispatchResult:
        try:
            data = strict_json(response.content)
            vectors = data["data"]
            if not isinstance(vectors, list):
                raise TypeError("data is not a list")
        except (ValueError, KeyError, TypeError) as exc:
            raise DispatchError(
                f"{self.executor.name}: malformed embeddings {response.text[:200]!r}",
                retryable=True,
                executor_fault=True,
            ) from exc
        usage = data.get("usage") or {}
        return DispatchResult(
            output={"model": data.get("model"), "data": vectors}, prompt_tokens=int(usage.get("prompt_tokens") or 0)
        )


def _merge_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Fold one streamed tool-call fragment into the calls so far: the first fragment of a call
    brings its id, type and name; later ones append to its arguments. Returns the call so far."""
    index = int(delta.get("index") or 0)
    call = calls.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call["id"] = delta.get("id") or call["id"]
    call["type"] = delta.get("type") or call["type"]
    function = delta.get("function") or {}
    call["function"]["name"] += function.get("name") or ""
    call["function"]["arguments"] += function.get("arguments") or ""
    return index, call


class RemoteModelDriver(LocalModelDriver):
    """A hosted or remote OpenAI-compatible endpoint that needs an API key (transport.api_key,
    api_key_env or headers: executors/credentials.py). Environment variables are read each time a
    client is built, so rotating one needs no database change."""

    kind = "remote-model"

    def headers(self) -> dict[str, str]:
        if not transport_has_credentials(self.executor.transport or {}):
            raise DispatchError(
                f"executor {self.executor.name} has no API key (transport.api_key, api_key_env or headers)",
                retryable=False,
            )
        return super().headers()


def job_header(request: DispatchRequest) -> dict[str, str]:
    return {"X-Telemachus-Job": str(request.job_id)}


def retry_after(response: Answer) -> float | None:
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None


def upstream_message(response: Answer) -> str:
    """The server's own error text: OpenAI-style `{"error": {"message": ...}}`, else the body."""
    try:
        body = json.loads(response.content)
    except ValueError:
        return response.text[:500] or response.reason
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    return str(body)[:500]
