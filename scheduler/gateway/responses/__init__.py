"""OpenAI's Responses API, `POST /v1/responses`, as a chat completion upstream: any executor that
speaks chat completions serves it, governed like any chat call (calls.py). Stateless: nothing
is kept after the answer, so whatever needs a stored response or conversation is refused.

| Responses request | chat completion | notes |
| --- | --- | --- |
| `model` | `model` | |
| `input` (string) | one `user` message | |
| `input` message items (`role` user / assistant / system / developer, `content` a string or `input_text`, `output_text`, `refusal`, `input_image` with `image_url` parts) | messages; `developer` becomes `system` (local model servers know no `developer` role); text parts are joined, images become `image_url` parts | `input_image` by `file_id`, `input_file`, `input_audio`: 400 (no file store) |
| `function_call` items | `tool_calls` of an assistant message (consecutive calls, and the text just before them, make one message) | |
| `function_call_output` items | `tool` messages (`call_id` → `tool_call_id`; text parts joined) | images in an output: 400 |
| `instructions` | a `system` message first | |
| `tools` of `type: function` (`name`, `description`, `parameters`, `strict`) | `tools` | other tool types (web search, file search, computer, MCP, custom, ...): 400, they run at OpenAI |
| `tool_choice` none / auto / required / `{"type": "function", "name"}` | the same in chat's shape | hosted-tool and `allowed_tools` choices: 400 |
| `parallel_tool_calls`, `temperature`, `top_p`, `user` | the same | |
| `max_output_tokens` | `max_tokens` | |
| `text.format` text / json_object / json_schema | `response_format` | `text.verbosity`: 400 (no such control upstream) |
| `stream: true` | a streamed job | Responses events (below) |
| `metadata` | echoed in the response | kept in no store |
| `store` false or absent, `include` empty, `truncation` disabled, `background` false, `service_tier` auto / default, `reasoning` empty, `stream_options`, `prompt_cache_key`, `prompt_cache_retention`, `safety_identifier` | accepted | hints that change no answer, or the defaults; the response says `store: false` |
| `store: true` | 400 | responses are not kept: nothing could be retrieved later |
| `previous_response_id`, `conversation`, `item_reference` items | 400 | responses are not kept: send the whole conversation in `input` |
| `reasoning` with an effort or summary, `reasoning` items | 400 | chat completions carry no reasoning; we never return reasoning items |
| `include` non-empty, `top_logprobs`, `max_tool_calls`, `prompt`, `truncation: auto`, `background: true`, other service tiers, any other field | 400 naming the field | what they ask cannot be done over chat completions |

The answer is a `response` object: a `message` output item with one `output_text` part (unless
the model only called tools), then a `function_call` item per tool call; `status` `completed`, or
`incomplete` (`max_output_tokens`, `content_filter`) from the finish reason; `usage` in input and
output tokens. Streamed: `response.created`, `response.in_progress`, then for text
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta` as the
model writes, `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`; for each tool call `response.output_item.added` when the model
names it, `response.function_call_arguments.delta` as it writes the arguments,
`response.function_call_arguments.done`, `response.output_item.done`; last `response.completed` (or `response.incomplete`) with the whole
response. A failure after the stream started ends it with `response.failed`. Errors are OpenAI's
shape, as on chat completions."""  # noqa: E501 (the mapping table's rows)

from typing import Any

from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.calls import model_call
from scheduler.gateway.dialect import Dialect, ModelCall, StreamWriter, answering_errors, respond_error, sse
from scheduler.gateway.errors import GatewayError, method_not_allowed
from scheduler.gateway.responses.answer import ResponsesWriter, response_object
from scheduler.gateway.responses.request import translate

__all__ = ["RESPONSES", "serve", "translate"]


class ResponsesDialect(Dialect):
    via = "responses"

    def translate(self, body: Any) -> ModelCall:
        return translate(body)

    def answer(self, *, job_id: int, created: int, call: ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return response_object(job_id=job_id, created=created, call=call, status="completed", result=result)

    def writer(self, *, job_id: int, created: int, call: ModelCall) -> StreamWriter:
        return ResponsesWriter(job_id=job_id, created=created, call=call)

    def late_error(self, error: GatewayError) -> bytes:
        data = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return sse({**data, "sequence_number": 0}, event="error")


RESPONSES = ResponsesDialect()


async def serve(request: Request, reply: Reply) -> None:
    """POST /v1/responses; every error leaves in OpenAI's shape."""
    if request.method != "POST":
        return await respond_error(reply, RESPONSES, method_not_allowed(request, "POST"))
    await answering_errors(reply, RESPONSES, model_call(request, reply, dialect=RESPONSES))
