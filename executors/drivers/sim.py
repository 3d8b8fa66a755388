"""The `sim` executor: an honest, labelled simulator that runs in the worker process.

It makes no model call. It waits a configurable latency, reports token counts derived from the
request, and fails at a configurable rate, so demos, tests and capacity planning can exercise the
whole scheduler without a model server. Every result says `"simulated": true`.

Knobs, read from the executor's `meta` (bounds in executors/simknobs.py):
    latency_ms        mean time per dispatch (default 50)
    jitter_ms         uniform ± spread around the mean (default 0)
    tokens_per_s      if set, adds completion_tokens / tokens_per_s seconds of generation time
    output_tokens     completion tokens per reply, capped by the request's max_tokens (default 16)
    fail_rate         probability in [0, 1] that a dispatch fails (default 0)
    embedding_dims    length of the vectors of an embeddings step (default 8; needs
                      `capabilities.embeddings: true`, like any executor that serves embeddings)

Asked with `tools`, it calls them deterministically (executors/simtools.py: a prompt holding
`[rounds:N]` makes N rounds), in the OpenAI format: the message carries `tool_calls` and the
finish reason is `tool_calls`.
"""

import asyncio
import random

from executors.contract import EMBEDDINGS_API, DispatchError, DispatchRequest, DispatchResult, ExecutorDriver
from executors.simknobs import KNOBS, knob
from executors.simtools import sim_tool_calls
from executors.tokens import count_prompt_tokens, embedding_inputs, simulated_embedding

# However the knobs combine (a long reply at a crawl), one dispatch waits at most this long.
MAX_DELAY_S = KNOBS["latency_ms"][2] / 1000


class SimDriver(ExecutorDriver):
    kind = "sim"

    def _knob(self, name: str) -> float:
        return knob(self.executor.meta, name)

    async def dispatch(self, request: DispatchRequest) -> DispatchResult:
        messages = request.input.get("messages") or []
        max_tokens = int(request.input.get("max_tokens") or 1_000_000)
        completion = min(int(self._knob("output_tokens")), max_tokens)
        latency = self._knob("latency_ms") / 1000
        jitter = self._knob("jitter_ms") / 1000
        tokens_per_s = self._knob("tokens_per_s")
        delay = max(0.0, latency + random.uniform(-jitter, jitter))
        if tokens_per_s > 0:
            delay += completion / tokens_per_s
        delay = min(delay, MAX_DELAY_S)
        if delay:
            await asyncio.sleep(delay)
        if random.random() < self._knob("fail_rate"):
            raise DispatchError("simulated failure (sim executor fail_rate)", retryable=False)
        if request.api == EMBEDDINGS_API:
            return self._embed(request)
        calls = sim_tool_calls(messages, request.input.get("tools"), request.input.get("tool_choice", "auto"))
        if calls:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls"
        else:
            last = str(messages[-1].get("content") or "") if messages else ""
            message = {
                "role": "assistant",
                "content": f"[simulated reply from {self.executor.name}] {last[:200]}".strip(),
            }
            finish = "length" if completion == max_tokens else "stop"
        return DispatchResult(
            output={"simulated": True, "model": request.model, "message": message, "finish_reason": finish},
            prompt_tokens=count_prompt_tokens(messages),
            completion_tokens=completion,
        )

    def _embed(self, request: DispatchRequest) -> DispatchResult:
        texts = embedding_inputs(request.input.get("input"))
        dims = int(self._knob("embedding_dims"))
        return DispatchResult(
            output={
                "simulated": True,
                "model": request.model,
                "data": [
                    {"object": "embedding", "index": i, "embedding": simulated_embedding(text, dims)}
                    for i, text in enumerate(texts)
                ],
            },
            prompt_tokens=sum(len(text.split()) for text in texts),
        )
