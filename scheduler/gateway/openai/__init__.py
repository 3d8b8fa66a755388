"""The OpenAI-compatible endpoint, governed: `POST /v1/chat/completions` (plain and `stream: true`),
`POST /v1/embeddings`, `GET /v1/models` and `GET /v1/models/{model}`; the router gives
`POST /v1/responses` to responses/.

Each model call is a `chat` job, submitted, waited for and relayed by calls.py (the part
every protocol shares); this module routes /v1/ and says how chat completions look: the body
is the job's input as it is (request.py checks it), the answer a `chat.completion` or a stream
of `chat.completion.chunk`s ending with `data: [DONE]` (answer.py). Errors leave in OpenAI's
shape.

The caller is the owner of the API token (`Authorization: Bearer KEY`); the team is the one the
`X-Telemachus-Team` header names, or the caller's only team; `X-Telemachus-Priority` asks for a
priority (the priority map may lower it). Every response about a job names it in
`X-Telemachus-Job`."""

from typing import Any

from executors.selectors import models_usable_by
from scheduler.connections import db, idempotent
from scheduler.gateway.asgi import Reply, Request
from scheduler.gateway.auth import client_address
from scheduler.gateway.caller import TEAM_HEADER, caller_for
from scheduler.gateway.calls import model_call
from scheduler.gateway.dialect import Dialect, ModelCall, StreamWriter, answering_errors, respond_error
from scheduler.gateway.errors import GatewayError, method_not_allowed, unknown_url
from scheduler.gateway.openai import answer
from scheduler.gateway.openai.request import chat_call, embeddings_call


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    return GatewayError(status, message, code=code).body()


class ChatDialect(Dialect):
    """OpenAI's chat completions: the job's input is the request itself."""

    via = "openai"

    def translate(self, body: Any) -> ModelCall:
        return chat_call(body)

    def answer(self, *, job_id: int, created: int, call: ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return answer.completion(job_id=job_id, created=created, model=call.model, result=result)

    def writer(self, *, job_id: int, created: int, call: ModelCall) -> StreamWriter:
        return answer.ChatWriter(job_id=job_id, created=created, call=call)


CHAT = ChatDialect()


async def serve(request: Request, reply: Reply, rest: str) -> None:
    """Route a /v1/ request; every error leaves in OpenAI's shape."""
    routes = {
        "chat/completions": ("POST", chat_completions),
        "embeddings": ("POST", embeddings),
        "models": ("GET", models),
    }
    path = rest.rstrip("/")
    if path.startswith("models/") and path != "models/":
        method, handler, kwargs = "GET", model_detail, {"model": path.removeprefix("models/")}
    elif path in routes:
        (method, handler), kwargs = routes[path], {}  # type: ignore[assignment]
    else:
        return await respond_error(reply, CHAT, unknown_url(request))
    if request.method != method:
        return await respond_error(reply, CHAT, method_not_allowed(request, method))
    await answering_errors(reply, CHAT, handler(request, reply, **kwargs))


# --- endpoints -----------------------------------------------------------------------------------


async def chat_completions(request: Request, reply: Reply) -> None:
    await model_call(request, reply, dialect=CHAT)


async def embeddings(request: Request, reply: Reply) -> None:
    await model_call(request, reply, dialect=EMBEDDINGS)


class EmbeddingsDialect(ChatDialect):
    """OpenAI's embeddings: a job of the embeddings API, answered as a list of vectors."""

    def translate(self, body: Any) -> ModelCall:
        return embeddings_call(body)

    def answer(self, *, job_id: int, created: int, call: ModelCall, result: dict[str, Any]) -> dict[str, Any]:
        return answer.embeddings(model=call.model, result=result)


EMBEDDINGS = EmbeddingsDialect()


async def models(request: Request, reply: Reply) -> None:
    offered = await db(
        _models,
        authorization=request.header("authorization"),
        team=request.header(TEAM_HEADER),
        address=client_address(request.scope),
    )
    await reply.json(200, answer.model_list(offered))


async def model_detail(request: Request, reply: Reply, model: str) -> None:
    offered = await db(
        _models,
        authorization=request.header("authorization"),
        team=request.header(TEAM_HEADER),
        address=client_address(request.scope),
    )
    if model not in offered:
        raise GatewayError(
            404,
            f"The model {model!r} does not exist or your team may not use it.",
            code="model_not_found",
            param="model",
            retry=False,
        )
    await reply.json(200, answer.model_object(model))


@idempotent
def _models(*, authorization: str | None, team: str | None, address: str) -> list[str]:
    """The models of the enabled executors the caller's team may use that answer model calls (and
    that its key, if it came with one, may call)."""
    caller = caller_for(authorization=authorization, team=team, confirm=True, address=address)
    return sorted(
        m for m in models_usable_by([caller.team.pk], chat=True, routes=True)[caller.team.pk] if caller.may_call(m)
    )
