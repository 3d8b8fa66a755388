"""The Messages API's answers: the `message`, plain or as the stream's events, built from the
chat job's result, and Anthropic's error shape."""

import json
from typing import Any

from scheduler.gateway.dialect import ModelCall, StreamWriter, sse
from scheduler.gateway.errors import INTERRUPTED, GatewayError
from scheduler.gateway.openai.answer import usage
from scheduler.gateway.relay import ToolPiece

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def anthropic_error(error: GatewayError) -> dict[str, Any]:
    """Anthropic's error shape; `code` is the gateway's own, the same as in OpenAI's shape."""
    detail = {"type": error_type(error.status), "message": error.message, "code": error.code}
    if error.param:
        detail["param"] = error.param
    return {"type": "error", "error": detail}


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return anthropic_error(GatewayError(status, message, code=code))


def message_id(job_id: int) -> str:
    return f"msg_{job_id}"


def content_blocks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply as content blocks: its text, then a `tool_use` block per tool call."""
    message = result.get("message") or {}
    text = str(message.get("content") or "")
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": function.get("name") or "",
                "input": _input(function),
            }
        )
    return blocks


def _input(function: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` is; a model that wrote something
    else has failed to call the tool, and the call says so (502) rather than inventing an input."""
    try:
        value = json.loads(function.get("arguments") or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise GatewayError(
            502,
            f"The model called {function.get('name')!r} with arguments that are not a JSON object.",
            type="api_error",
            code="invalid_tool_call",
            retry=False,
        )
    return value


def _usage(result: dict[str, Any]) -> dict[str, int]:
    used = usage(result)
    return {
        "input_tokens": used["prompt_tokens"],
        "output_tokens": used["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_object(*, job_id: int, call: ModelCall, result: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": message_id(job_id),
        "type": "message",
        "role": "assistant",
        "model": result.get("model") or call.model,
        "content": content_blocks(result),
        "stop_reason": STOP_REASONS.get(result.get("finish_reason") or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": _usage(result),
    }


class MessagesWriter(StreamWriter):
    """Anthropic's stream: `message_start`, content blocks one after the other as they come (the
    text, a `tool_use` block per tool call, each stopped when the next starts), `message_delta`,
    `message_stop`."""

    keepalive = sse({"type": "ping"}, event="ping")

    def __init__(self, *, job_id: int, created: int, call: ModelCall) -> None:
        super().__init__()
        self.job_id, self.call = job_id, call
        self.blocks: list[int | None] = []  # by block index: None a text block, else a tool call's index
        self.open = False  # whether the last block is still open

    def opening(self, text: str) -> bytes:
        start: dict[str, Any] = {
            "id": message_id(self.job_id),
            "type": "message",
            "role": "assistant",
            "model": self.call.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.call.context.get("prompt", 0), "output_tokens": 0},
        }
        return (
            sse({"type": "message_start", "message": start}, event="message_start")
            + self.keepalive
            + (self.text(text) if text else b"")
        )

    def _start(self, tool: int | None, block: dict[str, Any]) -> bytes:
        out = self._stop()
        self.blocks.append(tool)
        self.open = True
        data = {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}
        return out + sse(data, event="content_block_start")

    def _stop(self) -> bytes:
        if not self.open:
            return b""
        self.open = False
        return sse({"type": "content_block_stop", "index": len(self.blocks) - 1}, event="content_block_stop")

    def _current(self, tool: int | None) -> bool:
        return self.open and self.blocks[-1] == tool

    def _delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}
        return sse(data, event="content_block_delta")

    def text(self, text: str) -> bytes:
        out = b"" if self._current(None) else self._start(None, {"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def tool_piece(self, piece: ToolPiece) -> bytes | None:
        out = b""
        if piece.first:
            out = self._start(piece.index, {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}})
        elif not self._current(piece.index):
            # A piece of a call whose block another block has closed: it cannot be sent in order.
            # `closing` finds it unsent, and ends the stream rather than send a wrong input.
            return None
        if not piece.text:
            return out
        return out + self._delta({"type": "input_json_delta", "partial_json": piece.text})

    def closing(self, result: dict[str, Any], rest: str) -> bytes:
        content_blocks(result)  # before anything is written: it refuses tool inputs that are not objects
        rests = self.tool_rests(result)
        out = [self.text(rest)] if rest else []
        for index, call, left in rests:
            function = call.get("function") or {}
            if left is None:
                block: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.get("id") or "",
                    "name": function.get("name") or "",
                    "input": {},
                }
                out.append(self._start(index, block))
                left = str(function.get("arguments") or "")
            elif left and not self._current(index):
                raise INTERRUPTED
            if left:
                out.append(self._delta({"type": "input_json_delta", "partial_json": left}))
        out.append(self._stop())
        final = message_object(job_id=self.job_id, call=self.call, result=result)
        out += [
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": final["stop_reason"], "stop_sequence": None},
                    "usage": final["usage"],
                },
                event="message_delta",
            ),
            sse({"type": "message_stop"}, event="message_stop"),
        ]
        return b"".join(out)

    def failure(self, error: GatewayError) -> bytes:
        return sse(anthropic_error(error), event="error")
