"""The answers of OpenAI's chat completions and embeddings, from the chat job's result: the
`chat.completion`, its stream's `chat.completion.chunk`s (`ChatWriter`), the embeddings list, the
models list."""

from typing import Any

from scheduler.gateway.dialect import ModelCall, StreamWriter, sse
from scheduler.gateway.errors import GatewayError
from scheduler.gateway.relay import ToolPiece


def completion_id(job_id: int) -> str:
    return f"chatcmpl-{job_id}"


def usage(result: dict[str, Any] | None) -> dict[str, int]:
    reported = (result or {}).get("usage") or {}
    prompt, completion = int(reported.get("prompt_tokens") or 0), int(reported.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion(*, job_id: int, created: int, model: str, result: dict[str, Any]) -> dict[str, Any]:
    message = dict(result.get("message") or {"role": "assistant", "content": ""})
    message.setdefault("role", "assistant")
    return {
        "id": completion_id(job_id),
        "object": "chat.completion",
        "created": created,
        "model": result.get("model") or model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": result.get("finish_reason") or "stop", "logprobs": None}
        ],
        "usage": usage(result),
    }


def chunk(
    *,
    job_id: int,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    choices: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "id": completion_id(job_id),
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}] if choices else [],
        **extra,
    }


def embeddings(*, model: str, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": result.get("data") or [],
        "model": result.get("model") or model,
        "usage": {"prompt_tokens": usage(result)["prompt_tokens"], "total_tokens": usage(result)["prompt_tokens"]},
    }


def model_list(models: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [model_object(m) for m in models]}


def model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "telemachus"}


class ChatWriter(StreamWriter):
    """`chat.completion.chunk`s: the role with the first text, text deltas, tool call deltas (the
    first of a call with its id and name), the finish reason, usage if asked, `[DONE]`."""

    def __init__(self, *, job_id: int, created: int, call: ModelCall) -> None:
        super().__init__()
        self.job_id, self.created, self.call = job_id, created, call

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(
            chunk(job_id=self.job_id, created=self.created, model=self.call.model, delta=delta, finish_reason=finish)
        )

    def opening(self, text: str) -> bytes:
        return self._chunk({"role": "assistant", "content": text})

    def text(self, text: str) -> bytes:
        return self._chunk({"content": text})

    def tool_piece(self, piece: ToolPiece) -> bytes:
        if piece.first:
            call = {"index": piece.index, "id": piece.id, "type": "function"}
            return self._chunk({"tool_calls": [{**call, "function": {"name": piece.name, "arguments": piece.text}}]})
        return self._chunk({"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]})

    def closing(self, result: dict[str, Any], rest: str) -> bytes:
        out = [self._chunk({"content": rest})] if rest else []
        unsent, rests = [], []
        for index, call, left in self.tool_rests(result):
            if left is None:
                unsent.append({"index": index, **call})
            elif left:
                rests.append({"index": index, "function": {"arguments": left}})
        for delta in rests:
            out.append(self._chunk({"tool_calls": [delta]}))
        if unsent:
            out.append(self._chunk({"tool_calls": unsent}))
        out.append(self._chunk({}, result.get("finish_reason") or "stop"))
        if self.call.include_usage:
            out.append(
                sse(
                    chunk(
                        job_id=self.job_id,
                        created=self.created,
                        model=self.call.model,
                        delta={},
                        choices=False,
                        usage=usage(result),
                    )
                )
            )
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def failure(self, error: GatewayError) -> bytes:
        return sse(error.body())
