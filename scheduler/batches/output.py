"""A batch's output and error files, written once as it ends (feeder.py), from its lines and the
jobs they became, in line order: each line's custom_id appears exactly once, in one of the two
files, whatever worker or process died on the way, because the files are derived from the rows
and written in the transaction that ends the batch.

How an answered line reads depends on its API: the shapes are the gateway's (OpenAI's chat
completion, embeddings list, Responses object; Anthropic's message), registered here by
scheduler/gateway/batches/ (`shape_register`) through a loader the app installs when it starts
(`shapes_loader_install`), since the workers that write the files never import the gateway at
start: its dialects are half a second of a worker's start-up, paid at the first file written."""

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scheduler.batches.files import FileWriter
from scheduler.batches.models import Batch, BatchLine, StoredFile
from scheduler.models import Job, JobEvent

# (job id, created, line's model, job meta, result) -> the answer's body.
Shape = Callable[[int, int, str, dict[str, Any], dict[str, Any]], dict[str, Any]]
_SHAPES: dict[tuple[str, str], Shape] = {}
_loaders: list[Callable[[], None]] = []
_loading = threading.Lock()
READ_BATCH = 2000


def shape_register(*, api: str, endpoint: str, shape: Shape) -> None:
    _SHAPES[(api, endpoint)] = shape


def shapes_loader_install(loader: Callable[[], None]) -> None:
    """`loader` registers shapes (`shape_register`) when a shape is first needed."""
    _loaders.append(loader)


def _shape(api: str, endpoint: str) -> Shape:
    with _loading:
        while (api, endpoint) not in _SHAPES and _loaders:
            _loaders.pop(0)()
    return _SHAPES[(api, endpoint)]


@dataclass(frozen=True)
class Written:
    output: StoredFile | None
    errors: StoredFile | None
    completed: int
    failed: int
    canceled: int


def outputs_write(batch: Batch, *, now: datetime, ending: str) -> Written:
    """Write the batch's output file (answered lines) and error file (the rest), in the caller's
    transaction. `ending` says what a line that never ran became: `batch_expired` or
    `batch_cancelled`."""
    shape = _shape(batch.api, batch.endpoint)
    created = int(batch.created_at.timestamp())
    out = FileWriter(team_id=batch.team_id, user_id=batch.user_id, filename=f"{batch.pk}_output.jsonl", now=now)
    # Anthropic's results are one file, every request in it; OpenAI's are two.
    one = batch.api == Batch.Api.ANTHROPIC
    err = (
        out
        if one
        else FileWriter(team_id=batch.team_id, user_id=batch.user_id, filename=f"{batch.pk}_error.jsonl", now=now)
    )
    completed = failed = canceled = 0
    for line, job, refusal in _lines_with_jobs(batch):
        if job is not None and job.status == Job.Status.DONE:
            body = shape(job.pk, created, job.model, job.meta, job.result or {})
            out.line(_entry(batch, line, job.pk, status=200, body=body))
            completed += 1
            continue
        if line.error is not None:
            err.line(_entry(batch, line, None, error=line.error))
            failed += 1
        elif job is None or job.status == Job.Status.CANCELED:
            code = ending
            message = "This request was not run: the batch " + (
                "expired." if code == "batch_expired" else "was cancelled."
            )
            err.line(_entry(batch, line, job.pk if job else None, error={"code": code, "message": message}))
            canceled += 1
        else:
            err.line(_failure(batch, line, job, refusal))
            failed += 1
    written_out = out.close()
    written_err = None if one else err.close()
    return Written(
        output=_kept(written_out, empty_too=one),
        errors=_kept(written_err),
        completed=completed,
        failed=failed,
        canceled=canceled,
    )


def _kept(file: StoredFile | None, *, empty_too: bool = False) -> StoredFile | None:
    """The file, unless it is empty: an empty output or error file is not kept, and the batch
    names none (as OpenAI's does); Anthropic's one results file is kept even when empty."""
    if file is None or file.lines or empty_too:
        return file
    file.delete()
    return None


def _entry(
    batch: Batch,
    line: BatchLine,
    job_id: int | None,
    *,
    status: int | None = None,
    body: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> bytes:
    """One line of the output or error file, as the provider writes it."""
    request_id = f"req_{job_id}" if job_id else None
    if batch.api == Batch.Api.ANTHROPIC:
        if error is None:
            result: dict[str, Any] = {"type": "succeeded", "message": body}
        elif error.get("code") in ("batch_expired", "batch_cancelled"):
            result = {"type": "expired" if error["code"] == "batch_expired" else "canceled"}
        else:
            result = {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": error.get("type") or "api_error", "message": error["message"]},
                },
            }
        return json.dumps({"custom_id": line.custom_id, "result": result}).encode()
    entry = {
        "id": f"batch_req_{job_id}" if job_id else f"batch_req_{batch.pk}_{line.line}",
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body} if status is not None else None,
        "error": error,
    }
    return json.dumps(entry).encode()


def _failure(batch: Batch, line: BatchLine, job: Job, refusal: dict[str, Any] | None) -> bytes:
    """A line whose job failed: refused by a budget while it waited (the quota error, 429), or
    failed by its model server (the status it answered, else 500)."""
    if refusal is not None:
        code, status = str(refusal.get("error") or "quota_exceeded"), 429
        message = str(refusal.get("detail") or job.error)
    else:
        code, status, message = "server_error", 500, job.error or "The model call failed."
    body = {
        "error": {
            "message": message,
            "type": "server_error" if status >= 500 else "invalid_request_error",
            "code": code,
        }
    }
    return _entry(
        batch, line, job.pk, status=status, body=body, error={"code": code, "message": message, "line": line.line}
    )


def _lines_with_jobs(batch: Batch) -> Iterator[tuple[BatchLine, Job | None, dict[str, Any] | None]]:
    """Each line in order with the job it became (if it was fed) and, for a job that failed
    with a refusal (a spent budget), that refusal: READ_BATCH lines per query."""
    last = 0
    while True:
        lines = list(BatchLine.objects.filter(batch=batch, line__gt=last).order_by("line")[:READ_BATCH])
        if not lines:
            return
        last = lines[-1].line
        jobs = {
            job.batch_line: job
            for job in Job.objects.filter(batch=batch, batch_line__gte=lines[0].line, batch_line__lte=last).only(
                "id", "batch_line", "status", "result", "error", "model", "meta"
            )
        }
        failed = [job.pk for job in jobs.values() if job.status == Job.Status.FAILED]
        refusals = {
            job_id: meta.get("refusal")
            for job_id, meta in JobEvent.objects.filter(job_id__in=failed, event=JobEvent.Type.FAILED).values_list(
                "job_id", "meta"
            )
            if isinstance(meta, dict) and isinstance(meta.get("refusal"), dict)
        }
        for line in lines:
            job = jobs.get(line.line)
            yield line, job, refusals.get(job.pk) if job is not None else None
