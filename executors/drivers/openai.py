"""Drivers for model servers that speak the OpenAI-compatible chat completions API (Ollama, vLLM,
llama.cpp's server, LM Studio, hosted providers).

`endpoint` is the API base including its version prefix, for example http://127.0.0.1:11434/v1;
a chat step is `POST {endpoint}/chat/completions`. `transport` may set `timeout_s` (default 120)
and `connect_timeout_s` (default 5)."""

from typing import Any

import httpx

from executors.contract import DispatchError, DispatchRequest, DispatchResult, ExecutorDriver

# Request options a job may pass through to the model server, beside model and messages.
PASSTHROUGH_OPTIONS = (
    "max_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty",
    "response_format", "tools", "tool_choice", "user",
)
RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504}


def upstream_message(response: httpx.Response) -> str:
    """The server's own error text: OpenAI-style `{"error": {"message": ...}}`, else the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if isinstance(error, str):
            return error[:500]
    return str(body)[:500]


class LocalModelDriver(ExecutorDriver):
    kind = "local-model"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: httpx.AsyncClient | None = None

    def headers(self) -> dict[str, str]:
        return {}

    def client(self) -> httpx.AsyncClient:
        """One pooled client per executor and worker process, created on first use so it binds to
        the worker's event loop. Concurrency is bounded by slots, not by the pool."""
        if self._client is None:
            transport = self.executor.transport or {}
            timeout = httpx.Timeout(
                float(transport.get("timeout_s", 120)), connect=float(transport.get("connect_timeout_s", 5))
            )
            self._client = httpx.AsyncClient(
                base_url=(self.executor.endpoint or "").rstrip("/"),
                timeout=timeout,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                headers=self.headers(),
            )
        return self._client

    def request_body(self, request: DispatchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": request.model, "messages": request.input.get("messages") or []}
        body.update({k: request.input[k] for k in PASSTHROUGH_OPTIONS if k in request.input})
        return body

    async def dispatch(self, request: DispatchRequest) -> DispatchResult:
        if not self.executor.endpoint:
            raise DispatchError(f"executor {self.executor.name} has no endpoint", retryable=False)
        try:
            response = await self.client().post("/chat/completions", json=self.request_body(request))
        except httpx.TimeoutException as exc:
            raise DispatchError(f"timeout talking to {self.executor.name}: {exc!r}", retryable=True) from exc
        except httpx.TransportError as exc:
            raise DispatchError(f"cannot reach {self.executor.name}: {exc!r}", retryable=True) from exc
        if response.status_code >= 400:
            raise DispatchError(
                f"{self.executor.name} answered {response.status_code}: {upstream_message(response)}",
                retryable=response.status_code in RETRYABLE_STATUS,
                status=response.status_code,
                retry_after=_retry_after(response),
            )
        return parse_completion(response)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def parse_completion(response: httpx.Response) -> DispatchResult:
    try:
        data = response.json()
        choice = data["choices"][0]
        message = choice["message"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise DispatchError(f"malformed completion from model server: {response.text[:200]!r}", retryable=False) from exc
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
