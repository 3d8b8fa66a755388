"""The OpenAI-compatible endpoint, governed: `POST /v1/chat/completions` (plain and `stream: true`),
`POST /v1/responses` (responses/), `POST /v1/embeddings`, `GET /v1/models` and
`GET /v1/models/{model}`.

Each model call is a `chat` job, submitted, waited for and relayed by calls.py (the part
every protocol shares); this module routes /v1/ and says how chat completions look: the body
is the job's input as it is (shapes.py checks it), the answer a `chat.completion` or a stream
of `chat.completion.chunk`s ending with `data: [DONE]`. Errors leave in OpenAI's shape.

The caller is the owner of the API token (`Authorization: Bearer KEY`); the team is the one the
`X-Telemachus-Team` header names, or the caller's only team; `X-Telemachus-Priority` asks for a
priority (the priority map may lower it). Every response about a job names it in
`X-Telemachus-Job`."""

from typing import Any

from executors.selectors import models_usable_by
from scheduler.gateway import responses, shapes
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.auth import client_address
from scheduler.gateway.calls import (
    TEAM_HEADER,
    Dialect,
    StreamWriter,
    answering_errors,
    caller_for,
    model_call,
    respond_error,
    sse,
)
from scheduler.gateway.database import db
from scheduler.gateway.feed import ToolPiece


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return shapes.OpenAIError(status, message, code=code).body()


class ChatDialect(Dialect):
    """OpenAI's chat completions: the job's input is the request itself."""

    via = "openai"

    def translate(self, body: Any) -> shapes.ModelCall:
        return shapes.chat_call(body)

    def answer(self, *, job_id: int, created: int, call: shapes.ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return shapes.completion(job_id=job_id, created=created, model=call.model, result=result)

    def writer(self, *, job_id: int, created: int, call: shapes.ModelCall) -> StreamWriter:
        return ChatWriter(job_id=job_id, created=created, call=call)


class ChatWriter(StreamWriter):
    """`chat.completion.chunk`s: the role with the first text, text deltas, tool call deltas (the
    first of a call with its id and name), the finish reason, usage if asked, `[DONE]`."""

    def __init__(self, *, job_id: int, created: int, call: shapes.ModelCall) -> None:
        super().__init__()
        self.job_id, self.created, self.call = job_id, created, call

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(
            shapes.chunk(
                job_id=self.job_id, created=self.created, model=self.call.model, delta=delta, finish_reason=finish
            )
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
                    shapes.chunk(
                        job_id=self.job_id,
                        created=self.created,
                        model=self.call.model,
                        delta={},
                        choices=False,
                        usage=shapes.usage(result),
                    )
                )
            )
        out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    def failure(self, error: shapes.OpenAIError) -> bytes:
        return sse(error.body())


CHAT = ChatDialect()


async def serve(request: Request, reply: Reply, rest: str) -> None:
    """Route a /v1/ request; every error leaves in OpenAI's shape."""
    routes = {
        "chat/completions": ("POST", chat_completions),
        "responses": ("POST", responses.create),
        "embeddings": ("POST", embeddings),
        "models": ("GET", models),
    }
    path = rest.rstrip("/")
    if path.startswith("models/") and path != "models/":
        method, handler, kwargs = "GET", model_detail, {"model": path.removeprefix("models/")}
    elif path in routes:
        (method, handler), kwargs = routes[path], {}  # type: ignore[assignment]
    else:
        return await respond_error(
            reply,
            CHAT,
            shapes.OpenAIError(404, f"Unknown path: {request.method} {request.path}", code="unknown_url", retry=False),
        )
    if request.method != method:
        return await respond_error(
            reply,
            CHAT,
            shapes.OpenAIError(
                405,
                f"{request.method} is not allowed on {request.path}; use {method}.",
                code="method_not_allowed",
                retry=False,
            ),
        )
    await answering_errors(reply, CHAT, handler(request, reply, **kwargs))


# --- endpoints -----------------------------------------------------------------------------------


async def chat_completions(request: Request, reply: Reply) -> None:
    await model_call(request, reply, dialect=CHAT)


async def embeddings(request: Request, reply: Reply) -> None:
    await model_call(request, reply, dialect=EMBEDDINGS)


class EmbeddingsDialect(ChatDialect):
    """OpenAI's embeddings: a job of the embeddings API, answered as a list of vectors."""

    def translate(self, body: Any) -> shapes.ModelCall:
        return shapes.embeddings_call(body)

    def answer(self, *, job_id: int, created: int, call: shapes.ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return shapes.embeddings(model=call.model, result=result)


EMBEDDINGS = EmbeddingsDialect()


async def models(request: Request, reply: Reply) -> None:
    offered = await db(
        _models,
        authorization=request.header("authorization"),
        team=request.header(TEAM_HEADER),
        address=client_address(request.scope),
    )
    await reply.json(200, shapes.model_list(offered))


async def model_detail(request: Request, reply: Reply, model: str) -> None:
    offered = await db(
        _models,
        authorization=request.header("authorization"),
        team=request.header(TEAM_HEADER),
        address=client_address(request.scope),
    )
    if model not in offered:
        raise shapes.OpenAIError(
            404,
            f"The model {model!r} does not exist or your team may not use it.",
            code="model_not_found",
            param="model",
            retry=False,
        )
    await reply.json(200, shapes.model_object(model))


def _models(*, authorization: str | None, team: str | None, address: str) -> list[str]:
    """The models of the enabled executors the caller's team may use that answer model calls (and
    that its key, if it came with one, may call)."""
    caller = caller_for(authorization=authorization, team=team, confirm=True, address=address)
    return sorted(m for m in models_usable_by([caller.team.pk], chat=True)[caller.team.pk] if caller.may_call(m))
