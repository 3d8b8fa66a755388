"""Anthropic's Messages API, `POST /v1/messages` and `POST /v1/messages/count_tokens`, as a chat
completion upstream: any executor that speaks chat completions serves it, governed like any chat
call (calls.py). The official SDK works unchanged with `base_url` set to the server's root
(it adds `/v1/messages`); the token goes in `x-api-key` (as the SDK sends it) or
`Authorization: Bearer`. Errors are Anthropic's shape,
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, with our code
beside them (`error.code`) and the status codes the SDK maps to its exceptions.

| Messages request | chat completion | notes |
| --- | --- | --- |
| `model`, `max_tokens` (required), `temperature`, `top_p` | the same | |
| `system` (a string or text blocks) | a `system` message first | |
| `messages`: `user` / `assistant`, content a string or blocks | messages | |
| `text` blocks | text (several join into one string) | `cache_control`, `citations` on a block: accepted, no effect (hints) |
| `image` blocks (`base64` or `url` source) | `image_url` parts (base64 as a data URL) | `file` sources: 400 (no file store) |
| `tool_use` blocks (assistant) | `tool_calls` (`input` → JSON `arguments`) | |
| `tool_result` blocks (user) | `tool` messages, before the user's other content; text blocks joined | `is_error: true` prefixes the content with `[tool error] ` (chat completions has no such flag); images in a result: 400 |
| `tools` (`name`, `description`, `input_schema`) | function `tools` | Anthropic's typed tools (bash, text editor, web search, computer, ...): 400, they run at Anthropic |
| `tool_choice` auto / any / tool / none | auto / required / the function / none | `disable_parallel_tool_use: true` → `parallel_tool_calls: false` |
| `stop_sequences` | `stop` | |
| `metadata.user_id` | `user` | |
| `output_config.format` (or `output_format`) json_schema | `response_format` json_schema | `output_config.effort`: 400 |
| `stream: true` | a streamed job | Anthropic's events (below) |
| `thinking` disabled, `service_tier` auto / standard_only, `cache_control` | accepted | the defaults, or hints that change no answer |
| `thinking` enabled / adaptive, `top_k`, `thinking` / `redacted_thinking` / `document` / server tool blocks, any other field | 400 naming the field | chat completions cannot carry them |

The answer is a `message`: a `text` block (when the model wrote text), then a `tool_use` block
per tool call; `stop_reason` from the finish reason (stop → `end_turn`, length → `max_tokens`,
tool_calls → `tool_use`, content_filter → `refusal`; chat completions do not say which stop
sequence matched, so a stop sequence reads as `end_turn`); `usage` in input and output tokens.
Streamed: `message_start` (its `input_tokens` the prompt as counted for the budget estimate),
`ping`, `content_block_start` / `content_block_delta` (`text_delta`, or a tool call's
`input_json_delta`, as the model writes) / `content_block_stop` per block, `message_delta`
(stop reason, and the usage the model server reported), `message_stop`; a failure after the
stream started is an `error` event. `count_tokens` answers `{"input_tokens": N}` by the same
stand-in count the budget estimate uses (executors/tokens.py), without a job."""  # noqa: E501 (the mapping table's rows)

from typing import Any

from executors.selectors import models_usable_by
from scheduler.connections import db, idempotent
from scheduler.gateway.anthropic.answer import MessagesWriter, anthropic_error, error_body, message_object
from scheduler.gateway.anthropic.request import translate
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.auth import client_address
from scheduler.gateway.caller import TEAM_HEADER, caller_for
from scheduler.gateway.calls import model_call
from scheduler.gateway.dialect import Dialect, ModelCall, StreamWriter, answering_errors, parse_body, respond_error, sse
from scheduler.gateway.errors import GatewayError, method_not_allowed, unknown_url

__all__ = ["MESSAGES", "error_body", "serve", "translate"]


class MessagesDialect(Dialect):
    via = "anthropic"
    api_key_header = "x-api-key"

    def translate(self, body: Any) -> ModelCall:
        return translate(body)

    def answer(self, *, job_id: int, created: int, call: ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return message_object(job_id=job_id, call=call, result=result)

    def writer(self, *, job_id: int, created: int, call: ModelCall) -> StreamWriter:
        return MessagesWriter(job_id=job_id, created=created, call=call)

    def error_body(self, error: GatewayError) -> dict[str, Any]:
        return anthropic_error(error)

    def late_error(self, error: GatewayError) -> bytes:
        return sse(anthropic_error(error), event="error")


MESSAGES = MessagesDialect()


async def serve(request: Request, reply: Reply, rest: str | None = None) -> None:
    """Route /v1/messages and /v1/messages/count_tokens; every error leaves in Anthropic's shape."""
    routes = {"": create, "/count_tokens": count_tokens}
    handler = routes.get((rest or "").rstrip("/"))
    if handler is None:
        return await respond_error(reply, MESSAGES, unknown_url(request, retry=None))
    if request.method != "POST":
        return await respond_error(reply, MESSAGES, method_not_allowed(request, "POST", retry=None))
    await answering_errors(reply, MESSAGES, handler(request, reply))


async def create(request: Request, reply: Reply) -> None:
    """POST /v1/messages."""
    await model_call(request, reply, dialect=MESSAGES)


async def count_tokens(request: Request, reply: Reply) -> None:
    """POST /v1/messages/count_tokens: the prompt's tokens by the budget estimate's count; no job."""
    counted = await db(
        _count,
        authorization=MESSAGES.authorization(request),
        team=request.header(TEAM_HEADER),
        body=request.body,
        address=client_address(request.scope),
    )
    await reply.json(200, {"input_tokens": counted})


@idempotent
def _count(*, authorization: str | None, team: str | None, body: bytes, address: str) -> int:
    caller = caller_for(
        authorization=authorization, team=team, confirm=True, address=address, api_key_header=MESSAGES.api_key_header
    )
    call = translate(parse_body(body), counting=True)
    if call.model not in models_usable_by([caller.team.pk], chat=True, routes=True)[
        caller.team.pk
    ] or not caller.may_call(call.model):
        raise GatewayError(
            404, f"The model {call.model!r} does not exist or your team may not use it.", code="model_not_found"
        )
    return int(call.context["prompt"])
