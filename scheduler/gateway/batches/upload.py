"""`POST /v1/files`: a multipart upload (`purpose`, `file`) taken as a stream. The router hands
this handler the request before reading its body (the body cap of other paths,
TELEMACHUS_MAX_BODY_BYTES, does not apply: TELEMACHUS_BATCH_FILE_MAX_BYTES does); the body is
parsed a piece at a time as it arrives, and the file's bytes are written to storage
(scheduler/batches/files.py) a chunk at a time, so at most one chunk of it is ever in memory. The
caller is authenticated before the body is read."""

from typing import Any

from django.conf import settings
from django.utils import timezone
from python_multipart.multipart import MultipartParser, parse_options_header

from scheduler.batches.files import file_chunk_write, file_create, file_discard, file_processed
from scheduler.batches.models import FILE_CHUNK_BYTES, StoredFile
from scheduler.connections import db
from scheduler.gateway.asgi import Receive, Reply, Request, Scope, Send
from scheduler.gateway.auth import client_address
from scheduler.gateway.batches.shapes import file_object
from scheduler.gateway.caller import TEAM_HEADER, Caller, caller_for
from scheduler.gateway.errors import GatewayError, bad_request, from_domain
from telemachus.errors import DomainError
from telemachus.http.body_limit import body_drain

# Form fields besides the file are short (`purpose`).
MAX_FIELD_BYTES = 1024


class _Part:
    def __init__(self) -> None:
        self.headers: dict[str, str] = {}
        self.field, self.value = b"", b""
        self.name = self.filename = ""


class Upload:
    """The multipart parser's callbacks: form fields into `fields`, the file's bytes into
    `pending`, which the handler writes out a chunk at a time between pieces of the body."""

    def __init__(self, boundary: bytes) -> None:
        self.fields: dict[str, str] = {}
        self.pending = bytearray()
        self.filename: str | None = None
        self.part = _Part()
        self.size = self.newlines = 0
        self.last = b""
        self.parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._data,
                "on_part_end": self._end,
            },
        )

    def _begin(self) -> None:
        self.part = _Part()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self.part.field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self.part.value += data[start:end]

    def _header_end(self) -> None:
        self.part.headers[self.part.field.decode("latin1").lower()] = self.part.value.decode("latin1")
        self.part.field, self.part.value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self.part.headers.get("content-disposition", ""))
        self.part.name = options.get(b"name", b"").decode("utf-8", "replace")
        if self.part.name == "file":
            if self.filename is not None:
                raise bad_request("Send one file.", "file")
            self.filename = options.get(b"filename", b"upload.jsonl").decode("utf-8", "replace")

    def _data(self, data: bytes, start: int, end: int) -> None:
        piece = data[start:end]
        if self.part.name == "file":
            self.pending += piece
            self.size += len(piece)
            self.newlines += piece.count(b"\n")
            if piece:
                self.last = piece[-1:]
        else:
            value = self.fields.get(self.part.name, "") + piece.decode("utf-8", "replace")
            if len(value) > MAX_FIELD_BYTES:
                raise bad_request(f"The form field {self.part.name!r} is too long.", self.part.name)
            self.fields[self.part.name] = value

    def _end(self) -> None:
        self.part = _Part()

    @property
    def lines(self) -> int:
        return self.newlines + (1 if self.size and self.last != b"\n" else 0)


async def upload(scope: Scope, receive: Receive, send: Send, *, error: Any) -> None:
    """Serve POST /v1/files; `error` renders a GatewayError before the reply has started."""
    request = Request(scope, b"")
    stored: StoredFile | None = None
    read_all = False
    try:
        caller = await db(
            caller_for,
            authorization=request.header("authorization"),
            team=request.header(TEAM_HEADER),
            confirm=True,
            address=client_address(scope),
        )
        kind, options = parse_options_header(request.header("content-type") or "")
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise bad_request("Send the file as multipart/form-data, with `purpose` and `file`.")
        length = request.header("content-length")
        if length is not None and length.isdigit() and int(length) > settings.TELEMACHUS_BATCH_FILE_MAX_BYTES + 65536:
            raise _too_large()
        form = Upload(boundary)
        stored, seq = None, 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if stored is not None:
                    await db(file_discard, file_id=stored.pk)
                return
            form.parser.write(message.get("body", b""))
            if form.size > settings.TELEMACHUS_BATCH_FILE_MAX_BYTES:
                raise _too_large()
            if form.newlines > settings.TELEMACHUS_BATCH_MAX_LINES:
                raise bad_request(f"The file has more than {settings.TELEMACHUS_BATCH_MAX_LINES} lines.", "file")
            more = bool(message.get("more_body"))
            read_all = not more
            while len(form.pending) >= FILE_CHUNK_BYTES or (form.pending and not more):
                if stored is None:
                    stored = await db(_create, caller=caller, fields=form.fields, filename=form.filename or "")
                piece = bytes(form.pending[:FILE_CHUNK_BYTES])
                del form.pending[:FILE_CHUNK_BYTES]
                await db(file_chunk_write, file_id=stored.pk, seq=seq, data=piece)
                seq += 1
            if not more:
                break
        form.parser.finalize()
        if form.filename is None or not form.size:
            raise bad_request("The upload has no file (or an empty one) in its `file` field.", "file")
        if form.lines > settings.TELEMACHUS_BATCH_MAX_LINES:
            raise bad_request(f"The file has more than {settings.TELEMACHUS_BATCH_MAX_LINES} lines.", "file")
        assert stored is not None
        done = await db(file_processed, file_id=stored.pk, size=form.size, lines=form.lines)
        stored = None
    except (GatewayError, DomainError) as exc:
        failure = exc if isinstance(exc, GatewayError) else from_domain(exc)
        if stored is not None:
            await db(file_discard, file_id=stored.pk)
        if not read_all:
            await body_drain(receive)  # so the client reads the answer, not a reset
        reply = Reply(receive, send, scope)
        try:
            await reply.json(failure.status, error(failure), failure.headers)
        finally:
            reply.close()
        return
    reply = Reply(receive, send, scope)
    try:
        await reply.json(200, file_object(done))
    finally:
        reply.close()


def _create(*, caller: Caller, fields: dict[str, str], filename: str) -> StoredFile:
    purpose = fields.get("purpose")
    if purpose != StoredFile.Purpose.BATCH:
        raise bad_request("'purpose' must be 'batch' (and sent before the file).", "purpose")
    return file_create(team=caller.team, user=caller.user, purpose=purpose, filename=filename, now=timezone.now())


def _too_large() -> GatewayError:
    return GatewayError(
        413,
        f"The file is larger than {settings.TELEMACHUS_BATCH_FILE_MAX_BYTES} bytes.",
        code="payload_too_large",
        retry=False,
    )
