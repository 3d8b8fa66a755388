"""A batch's input, checked line by line before anything is queued, as OpenAI checks it.

A line that cannot be read as a request of the batch (not JSON, no `custom_id` or a repeated
one, a method other than POST, a `url` other than the batch's endpoint, no `body` object) fails
the whole batch at validation, each such line named with its number in the batch's
`errors.data` (at most MAX_ERRORS of them), as OpenAI fails it. A line whose request the endpoint
would refuse as a live call (its body's checks: the dialect's `translate`) becomes an entry of
the error file, with its number; the other lines run. What only admission knows (the key's
models, an executor for the model, budgets) is checked as each line is fed, and a refusal is an
entry of the error file too."""

from collections.abc import Iterable, Iterator
from typing import Any

from executors.contract import EMBEDDINGS_API
from scheduler.batches.services import MAX_ERRORS, CheckedLine, InvalidInput
from scheduler.gateway.dialect import Dialect, parse_body
from scheduler.gateway.errors import GatewayError, bad_request

MAX_CUSTOM_ID = 512


def openai_lines(raw: Iterable[bytes], *, endpoint: str, dialect: Dialect) -> Iterator[CheckedLine]:
    """Check each line of an OpenAI batch input file (JSONL of `{custom_id, method, url, body}`)."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    number = 0
    for number, text in enumerate(raw, start=1):  # noqa: B007 (the last number is the count)
        if not text.strip():
            _invalid(errors, number, "empty_line", "The line is empty.")
            continue
        try:
            item = parse_body(text)
        except GatewayError as exc:
            _invalid(errors, number, "invalid_json_line", f"The line is not valid JSON: {exc.message}")
            continue
        if not isinstance(item, dict):
            _invalid(errors, number, "invalid_json_line", "The line must be a JSON object.")
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
            _invalid(
                errors,
                number,
                "missing_custom_id",
                f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID} characters.",
                "custom_id",
            )
            continue
        if custom_id in seen:
            _invalid(
                errors,
                number,
                "duplicate_custom_id",
                f"The custom_id {custom_id!r} is used more than once.",
                "custom_id",
            )
            continue
        seen.add(custom_id)
        if item.get("method") != "POST":
            _invalid(errors, number, "invalid_method", "'method' must be POST.", "method")
            continue
        if item.get("url") != endpoint:
            _invalid(errors, number, "invalid_url", f"'url' must be the batch's endpoint, {endpoint}.", "url")
            continue
        if not isinstance(item.get("body"), dict):
            _invalid(errors, number, "missing_body", "'body' must be an object.", "body")
            continue
        if not errors:
            yield checked_line(number, custom_id, item["body"], dialect)
    if errors:
        raise InvalidInput(errors)


def checked_line(number: int, custom_id: str, body: dict[str, Any], dialect: Dialect) -> CheckedLine:
    """One request of a batch as the chat job it becomes, or, when its endpoint would refuse it
    as a live call, the error it would get, naming the line."""
    try:
        if body.get("stream"):
            raise bad_request("A batch's requests cannot stream.", "stream")
        call = dialect.translate(body)
    except GatewayError as exc:
        error = {"code": exc.code, "message": exc.message, "param": exc.param, "line": number}
        return CheckedLine(line=number, custom_id=custom_id, error=error)
    requirements: dict[str, Any] = {"model": call.model, "est_tokens": call.est_tokens}
    if call.api == EMBEDDINGS_API:
        requirements["api"] = EMBEDDINGS_API
    return CheckedLine(
        line=number,
        custom_id=custom_id,
        requirements=requirements,
        input=call.input,
        meta={"model": call.model, "context": call.context} if call.context else {"model": call.model},
    )


def _invalid(errors: list[dict[str, Any]], line: int, code: str, message: str, param: str | None = None) -> None:
    if len(errors) < MAX_ERRORS:
        errors.append({"code": code, "message": message, "param": param, "line": line})
