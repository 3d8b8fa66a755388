"""How files and batches look to the SDKs (OpenAI's `file` and `batch` objects, Anthropic's
`message_batch`), and the answers batch lines are written with (registered with
scheduler/batches/output.py by `shapes_register`, which the app installs as the loader of shapes)."""

from datetime import datetime
from typing import Any

from scheduler.batches.models import Batch, StoredFile
from scheduler.batches.output import shape_register
from scheduler.batches.services import Counts
from scheduler.gateway.anthropic import MESSAGES
from scheduler.gateway.dialect import Dialect, ModelCall
from scheduler.gateway.openai import CHAT, EMBEDDINGS
from scheduler.gateway.responses import RESPONSES

# The endpoints a batch may name, and the dialect that checks and answers each line.
OPENAI_ENDPOINTS: dict[str, Dialect] = {
    "/v1/chat/completions": CHAT,
    "/v1/embeddings": EMBEDDINGS,
    "/v1/responses": RESPONSES,
}
ANTHROPIC_ENDPOINT = "/v1/messages"


def shapes_register() -> None:
    for endpoint, dialect in OPENAI_ENDPOINTS.items():
        shape_register(api=Batch.Api.OPENAI, endpoint=endpoint, shape=_shape(dialect))
    shape_register(api=Batch.Api.ANTHROPIC, endpoint=ANTHROPIC_ENDPOINT, shape=_shape(MESSAGES))


def _shape(dialect: Dialect) -> Any:
    def shape(job_id: int, created: int, model: str, meta: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
        call = ModelCall(model=meta.get("model") or model, input={}, est_tokens=0, context=meta.get("context") or {})
        return dialect.answer(job_id=job_id, created=created, call=call, result=result)

    return shape


def _stamp(at: datetime | None) -> int | None:
    return int(at.timestamp()) if at is not None else None


def _iso(at: datetime | None) -> str | None:
    return at.isoformat().replace("+00:00", "Z") if at is not None else None


def file_object(file: StoredFile) -> dict[str, Any]:
    return {
        "id": file.pk,
        "object": "file",
        "bytes": file.bytes,
        "created_at": _stamp(file.created_at),
        "expires_at": None,
        "filename": file.filename,
        "purpose": file.purpose,
        "status": file.status,
        "status_details": None,
    }


def batch_object(batch: Batch, counts: Counts) -> dict[str, Any]:
    """OpenAI's `batch` object."""
    return {
        "id": batch.pk,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": batch.errors,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id or None,
        "error_file_id": batch.error_file_id or None,
        "created_at": _stamp(batch.created_at),
        "in_progress_at": _stamp(batch.in_progress_at),
        "expires_at": _stamp(batch.expires_at),
        "finalizing_at": _stamp(batch.finalizing_at),
        "completed_at": _stamp(batch.completed_at),
        "failed_at": _stamp(batch.failed_at),
        "expired_at": _stamp(batch.expired_at) if batch.status == Batch.Status.EXPIRED else None,
        "cancelling_at": _stamp(batch.cancelling_at),
        "cancelled_at": _stamp(batch.cancelled_at),
        "request_counts": counts.as_dict(),
        "metadata": batch.metadata,
    }


def message_batch_object(batch: Batch, counts: Counts, *, base: str) -> dict[str, Any]:
    """Anthropic's `message_batch` object; `base` is this server's URL, for `results_url`."""
    ended = batch.status in Batch.ENDED
    status = "ended" if ended else "canceling" if batch.status == Batch.Status.CANCELLING else "in_progress"
    expired = counts.canceled if batch.status == Batch.Status.EXPIRED else 0
    return {
        "id": batch.pk,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": {
            "processing": counts.total - counts.completed - counts.failed - counts.canceled if not ended else 0,
            "succeeded": counts.completed,
            "errored": counts.failed,
            "canceled": counts.canceled - expired,
            "expired": expired,
        },
        "ended_at": _iso(batch.completed_at or batch.cancelled_at or (batch.expired_at if ended else None)),
        "created_at": _iso(batch.created_at),
        "expires_at": _iso(batch.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _iso(batch.cancelling_at),
        "results_url": f"{base}/v1/messages/batches/{batch.pk}/results" if ended else None,
    }


def page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
