"""The gateway's paths in the OpenAPI schema (/api/schema/, /api/docs/). They are served ahead of
Django's URLconf (scheduler/gateway/router.py), so drf-spectacular cannot find them by itself; this
postprocessing hook adds them, referring to the schema's own components where they apply."""

from typing import Any

from scheduler.gateway.jobwatch import DEFAULT_TIMEOUT, MAX_TIMEOUT

JOB = {"$ref": "#/components/schemas/JobOutput"}
API_ERROR = {"type": "object", "properties": {"error": {"type": "string"}, "detail": {"type": "string"}}}
OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}
ANTHROPIC_ERROR = {
    "type": "object",
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {
            "type": "object",
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string"},
                "code": {"type": "string", "nullable": True},
                "param": {"type": "string"},
            },
        },
    },
}
JOB_ID = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "integer"}}
TEAM_HEADER = {
    "name": "X-Telemachus-Team",
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "The team the call acts for; needed only by members of several teams.",
}
PRIORITY_HEADER = {
    "name": "X-Telemachus-Priority",
    "in": "header",
    "required": False,
    "schema": {"type": "integer", "minimum": -100, "maximum": 100},
    "description": "Requested priority; the queue policy's priority map may lower it.",
}
API_AUTH: list[dict[str, list[str]]] = [{"tokenAuth": []}, {"cookieAuth": []}]
BEARER: list[dict[str, list[str]]] = [{"bearerAuth": []}]
API_KEY: list[dict[str, list[str]]] = [{"apiKeyAuth": []}, {"bearerAuth": []}]


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


# One Server-Sent Event as a client parses it (OpenAPI 3.0 has no itemSchema: tools such as
# schemathesis read a text/event-stream schema as the schema of each event).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "JSON, or OpenAI's `[DONE]`."},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _openai_errors(*statuses: int) -> dict[str, Any]:
    return {str(status): _json(OPENAI_ERROR, "An error in OpenAI's shape.") for status in statuses}


def _anthropic(operation_id: str, summary: str, description: str, *, stream: bool) -> dict[str, Any]:
    """A path of Anthropic's Messages API: its errors are in Anthropic's shape."""
    operation = _openai(
        operation_id,
        summary,
        description,
        post=True,
        stream=stream,
        errors=(),
        parameters=(TEAM_HEADER, PRIORITY_HEADER) if stream else (TEAM_HEADER,),
    )["post"]
    statuses = (400, 401, 403, 404, 409, 413, 429, 502, 504) if stream else (400, 401, 403, 404, 413)
    operation["tags"] = ["anthropic"]
    operation["security"] = API_KEY
    operation["responses"].update(
        {str(status): _json(ANTHROPIC_ERROR, "An error in Anthropic's shape.") for status in statuses}
    )
    operation["responses"]["200"]["description"] = "As Anthropic's API answers."
    return {"post": operation}


def _openai(
    operation_id: str,
    summary: str,
    description: str,
    *,
    post: bool,
    errors: tuple[int, ...],
    stream: bool = False,
    parameters: tuple[dict[str, Any], ...] = (TEAM_HEADER,),
) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        ok["text/event-stream"] = {"schema": SSE_EVENT}
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "tags": ["openai"],
        "summary": summary,
        "description": description,
        "security": BEARER,
        "parameters": list(parameters),
        "responses": {"200": {"description": "As OpenAI's API answers.", "content": ok}, **_openai_errors(*errors)},
    }
    if post:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    return {"post" if post else "get": operation}


def gateway_paths(result: dict[str, Any], generator: Any, request: Any, public: bool) -> dict[str, Any]:
    """drf-spectacular's postprocessing hook: the gateway's paths and security schemes added."""
    paths = {**result.get("paths", {}), **_job_paths(), **_model_paths()}
    result["paths"] = dict(sorted(paths.items()))
    schemes = result.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["bearerAuth"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An app's API key (tm-...) or a person's API token (the same as `Authorization: Token KEY`).",
    }
    schemes["apiKeyAuth"] = {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "An API token, as Anthropic's SDK sends its key (the Messages API only).",
    }
    return result


def _job_paths() -> dict[str, Any]:
    """The job API's long-lived requests (scheduler/gateway/jobwatch.py)."""
    return {
        "/api/jobs/{job_id}/wait/": {
            "get": {
                "operationId": "jobs_wait_retrieve",
                "tags": ["jobs"],
                "security": API_AUTH,
                "summary": "Wait for a job to end",
                "description": "Answers when the job ends, or when the timeout passes, with the job as it is then. "
                "Woken by the job's own changes, not by polling.",
                "parameters": [
                    JOB_ID,
                    {
                        "name": "timeout",
                        "in": "query",
                        "required": False,
                        "description": "Seconds.",
                        "schema": {"type": "number", "minimum": 0, "maximum": MAX_TIMEOUT, "default": DEFAULT_TIMEOUT},
                    },
                ],
                "responses": {
                    "200": _json(JOB, "The job."),
                    "400": _json(API_ERROR, "Bad timeout."),
                    "401": _json(API_ERROR, "Not authenticated."),
                    "404": _json(API_ERROR, "No such job."),
                },
            }
        },
        "/api/jobs/{job_id}/stream/": {
            "get": {
                "operationId": "jobs_stream_retrieve",
                "tags": ["jobs"],
                "security": API_AUTH,
                "summary": "A job's status, events and output as they happen (Server-Sent Events)",
                "description": "Events: `job` (the job now), `event` (each job event, with its id as the SSE id; "
                "reconnect with Last-Event-ID to resume), `status`, `delta` (`{attempt, offset, text}` of "
                "a streamed job's output), `done` (the final job; the stream ends).",
                "parameters": [
                    JOB_ID,
                    {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "integer"}},
                ],
                "responses": {
                    "200": {"description": "An event stream.", "content": {"text/event-stream": {"schema": SSE_EVENT}}},
                    "401": _json(API_ERROR, "Not authenticated."),
                    "404": _json(API_ERROR, "No such job."),
                },
            }
        },
    }


def _model_paths() -> dict[str, Any]:
    """The three model APIs (OpenAI's chat completions, embeddings and models; the Responses API;
    Anthropic's Messages)."""
    return {
        "/v1/chat/completions": _openai(
            "v1_chat_completions_create",
            "Chat completion (OpenAI-compatible, governed)",
            "OpenAI's chat completions request (`stream`, `tools` and `tool_choice` included). It runs as a queued "
            "chat job under the team's caps and budgets; the answer is OpenAI's response, or its stream of chunks.",
            post=True,
            stream=True,
            errors=(400, 401, 403, 404, 409, 429, 502, 504),
            parameters=(TEAM_HEADER, PRIORITY_HEADER),
        ),
        "/v1/responses": _openai(
            "v1_responses_create",
            "Response (OpenAI's Responses API, governed, stateless)",
            "OpenAI's Responses request, translated to a chat completion: a queued chat job under the team's caps "
            "and budgets. Nothing is kept: `previous_response_id`, `conversation` and `store: true` are refused. "
            "What maps and what is refused: docs/gateway.md.",
            post=True,
            stream=True,
            errors=(400, 401, 403, 404, 409, 429, 502, 504),
            parameters=(TEAM_HEADER, PRIORITY_HEADER),
        ),
        "/v1/messages": _anthropic(
            "v1_messages_create",
            "Message (Anthropic's Messages API, governed)",
            "Anthropic's Messages request, translated to a chat completion: a queued chat job under the team's caps "
            "and budgets; the token as `x-api-key` or Bearer. What maps and what is refused: docs/gateway.md.",
            stream=True,
        ),
        "/v1/messages/count_tokens": _anthropic(
            "v1_messages_count_tokens",
            "Count a Messages request's input tokens",
            "The prompt's tokens as the budget estimate counts them; no job.",
            stream=False,
        ),
        "/v1/embeddings": _openai(
            "v1_embeddings_create",
            "Embeddings (OpenAI-compatible, governed)",
            "OpenAI's embeddings request, run by an executor that declares `capabilities.embeddings`.",
            post=True,
            errors=(400, 401, 403, 404, 429, 502, 504),
            parameters=(TEAM_HEADER, PRIORITY_HEADER),
        ),
        "/v1/models": _openai(
            "v1_models_list",
            "Models the team may use",
            "Models of the enabled executors the caller's team may use.",
            post=False,
            errors=(400, 401, 404),
        ),
    }
