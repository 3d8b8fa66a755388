"""The Responses API's answers: the `response` object, plain or as the stream's events, built
from the chat job's result."""

from typing import Any

from scheduler.gateway.dialect import ModelCall, StreamWriter, sse
from scheduler.gateway.errors import GatewayError
from scheduler.gateway.openai.answer import usage
from scheduler.gateway.relay import ToolPiece


def response_id(job_id: int) -> str:
    return f"resp_{job_id}"


def message_id(job_id: int) -> str:
    return f"msg_{job_id}"


def output_items(job_id: int, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's reply as output items: its text as a message (unless it only called tools),
    then one `function_call` per tool call."""
    message = result.get("message") or {}
    text, calls = str(message.get("content") or ""), message.get("tool_calls") or []
    status = "incomplete" if _incomplete(result) else "completed"
    items: list[dict[str, Any]] = []
    if text or not calls:
        items.append(_message_item(job_id, status, [_text_part(text)]))
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        items.append(
            {
                "type": "function_call",
                "id": _call_id(job_id, index),
                "call_id": call.get("id") or f"call_{job_id}_{index}",
                "name": function.get("name") or "",
                "arguments": function.get("arguments") or "",
                "status": "completed",
            }
        )
    return items


def _call_id(job_id: int, index: int) -> str:
    return f"fc_{job_id}_{index}"


def _call_index(item_id: str) -> int:
    return int(item_id.rsplit("_", 1)[1])


def _message_item(job_id: int, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": message_id(job_id), "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _incomplete(result: dict[str, Any]) -> str | None:
    return {"length": "max_output_tokens", "content_filter": "content_filter"}.get(result.get("finish_reason") or "")


def response_object(
    *,
    job_id: int,
    created: int,
    call: ModelCall,
    status: str,
    result: dict[str, Any] | None = None,
    error: GatewayError | None = None,
    output: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The `response` object, as the answer and as the stream's lifecycle events carry it."""
    context = call.context
    reason = _incomplete(result) if result is not None else None
    used = usage(result) if result is not None else None
    return {
        "id": response_id(job_id),
        "object": "response",
        "created_at": created,
        "status": "incomplete" if reason and status == "completed" else status,
        "background": False,
        "error": _error(error) if error else None,
        "incomplete_details": {"reason": reason} if reason else None,
        "instructions": context.get("instructions"),
        "max_output_tokens": context.get("max_output_tokens"),
        "metadata": context.get("metadata") or {},
        "model": (result or {}).get("model") or call.model,
        "output": output if output is not None else output_items(job_id, result) if result is not None else [],
        "parallel_tool_calls": context.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": False,
        "temperature": context.get("temperature"),
        "text": context.get("text") or {"format": {"type": "text"}},
        "tool_choice": context.get("tool_choice") or "auto",
        "tools": context.get("tools") or [],
        "top_p": context.get("top_p"),
        "truncation": "disabled",
        "usage": (
            {
                "input_tokens": used["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": used["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": used["total_tokens"],
            }
            if used
            else None
        ),
        "user": context.get("user"),
    }


def _error(error: GatewayError) -> dict[str, str]:
    """A failed response's error: OpenAI's few codes for it, and ours in the message."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {"code": code, "message": f"{error.message} ({error.code})" if error.code else error.message}


class ResponsesWriter(StreamWriter):
    """The Responses stream: lifecycle events around the output items' events, numbered. Items
    take their output index in the order they start: the message at its first text, a function
    call at its first piece."""

    def __init__(self, *, job_id: int, created: int, call: ModelCall) -> None:
        super().__init__()
        self.job_id, self.created, self.call = job_id, created, call
        self.sequence = 0
        self.started: list[str] = []  # item ids, by output index

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse(data, event=kind)

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return response_object(job_id=self.job_id, created=self.created, call=self.call, status=status, **extra)

    def opening(self, text: str) -> bytes:
        started = self._response("in_progress")
        return (
            self._event("response.created", response=started)
            + self._event("response.in_progress", response=started)
            + (self.text(text) if text else b"")
        )

    def _start(self, item: dict[str, Any]) -> bytes:
        """An output item's first events, at the next output index."""
        self.started.append(item["id"])
        index = len(self.started) - 1
        if item["type"] == "message":
            return self._event(
                "response.output_item.added", output_index=index, item={**item, "status": "in_progress", "content": []}
            ) + self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_text_part(""),
            )
        return self._event(
            "response.output_item.added",
            output_index=index,
            item={**item, "arguments": "", "status": "in_progress"},
        )

    def text(self, text: str) -> bytes:
        item_id = message_id(self.job_id)
        out = b"" if item_id in self.started else self._start(_message_item(self.job_id, "in_progress", []))
        return out + self._event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=self.started.index(item_id),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def tool_piece(self, piece: ToolPiece) -> bytes:
        item_id = _call_id(self.job_id, piece.index)
        out = b""
        if piece.first:
            item = {"type": "function_call", "id": item_id, "call_id": piece.id, "name": piece.name}
            out = self._start(item)
        if not piece.text:
            return out
        return out + self._event(
            "response.function_call_arguments.delta",
            item_id=item_id,
            output_index=self.started.index(item_id),
            delta=piece.text,
        )

    def closing(self, result: dict[str, Any], rest: str) -> bytes:
        rests = {index: left for index, _, left in self.tool_rests(result)}
        out = [self.text(rest)] if rest else []
        items = output_items(self.job_id, result)
        # The items as they were started, then those that were not, in the answer's order.
        order = {item_id: position for position, item_id in enumerate(self.started)}
        items.sort(key=lambda item: order.get(item["id"], len(order)))
        for index, item in enumerate(items):
            if item["id"] not in order:
                out.append(self._start(item))
            if item["type"] == "message":
                ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                part = item["content"][0]
                out += [
                    self._event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", **ids, part=part),
                ]
            else:
                ids = {"item_id": item["id"], "output_index": index}
                left = rests.get(_call_index(item["id"]))
                left = item["arguments"] if left is None else left
                if left:
                    out.append(self._event("response.function_call_arguments.delta", **ids, delta=left))
                out.append(
                    self._event(
                        "response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"]
                    )
                )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        final = self._response("completed", result=result, output=items)
        out.append(self._event(f"response.{final['status']}", response=final))
        return b"".join(out)

    def failure(self, error: GatewayError) -> bytes:
        return self._event("response.failed", response=self._response("failed", error=error))
