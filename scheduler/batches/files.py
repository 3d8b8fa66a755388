"""Stored files: written and read in chunks (models.py, FILE_CHUNK_BYTES), so neither an upload
nor a batch's output is ever held whole in memory. Every function runs on a database thread."""

from collections.abc import Iterator
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from scheduler.batches.models import FILE_CHUNK_BYTES, Batch, FileChunk, StoredFile, new_id
from telemachus.errors import Conflict, NotFound
from telemachus.models import Team
from telemachus.teams import rbac


def file_create(*, team: Team, user: rbac.Principal, purpose: str, filename: str, now: datetime) -> StoredFile:
    """A file being uploaded (status `uploaded` until `file_processed`): its chunks follow."""
    return StoredFile.objects.create(
        id=new_id("file-"),
        team=team,
        user=rbac.signed_in(user),
        purpose=purpose,
        filename=filename[:255],
        created_at=now,
    )


def file_chunk_write(*, file_id: str, seq: int, data: bytes) -> None:
    FileChunk.objects.create(file_id=file_id, seq=seq, data=data)


def file_processed(*, file_id: str, size: int, lines: int) -> StoredFile:
    """The upload is whole: its size and line count, and it may be used."""
    StoredFile.objects.filter(pk=file_id).update(bytes=size, lines=lines, status=StoredFile.Status.PROCESSED)
    return StoredFile.objects.get(pk=file_id)


def file_discard(*, file_id: str) -> None:
    """An upload that did not arrive whole (refused, or its client left): gone with its chunks."""
    StoredFile.objects.filter(pk=file_id).delete()


def file_for(*, team: Team, file_id: str) -> StoredFile:
    """The team's processed file (404 for anyone else's: existence never leaks)."""
    found = StoredFile.objects.filter(pk=file_id, team=team, status=StoredFile.Status.PROCESSED).first()
    if found is None:
        raise NotFound(
            f"No such File object: {file_id}. Files are removed by retention {settings.TELEMACHUS_RETENTION_HOURS:g} "
            "hours after they were uploaded or their batch ended (or their team's own retention_hours), and a "
            "batch's input and output files sooner when its team removes prompts and answers (body_retention_hours)."
        )
    return found


def files_of(*, team: Team, purpose: str | None, after: str | None, limit: int) -> list[StoredFile]:
    """The team's files, newest first, after the cursor `after` (a file id)."""
    files = StoredFile.objects.filter(team=team, status=StoredFile.Status.PROCESSED)
    if purpose:
        files = files.filter(purpose=purpose)
    if after:
        cursor = StoredFile.objects.filter(pk=after, team=team).values_list("created_at", flat=True).first()
        if cursor is not None:
            files = files.filter(Q(created_at__lt=cursor) | Q(created_at=cursor, pk__lt=after))
    return list(files.order_by("-created_at", "-id")[:limit])


def file_delete(*, team: Team, file_id: str) -> None:
    """Delete a file and its bytes; refused (409) while a batch under way reads it."""
    with transaction.atomic():
        found = file_for(team=team, file_id=file_id)
        if Batch.objects.filter(input_file_id=found.pk, status=Batch.Status.VALIDATING).exists():
            raise Conflict(f"File {file_id} is being read by a batch.")
        found.delete()


def file_chunk(*, file_id: str, seq: int) -> bytes | None:
    """The file's `seq`th chunk, or None past its end (one query: a reader holds one chunk)."""
    data = FileChunk.objects.filter(file_id=file_id, seq=seq).values_list("data", flat=True).first()
    return bytes(data) if data is not None else None


def file_lines(*, file_id: str) -> Iterator[bytes]:
    """The file's lines (without their line ends), read a chunk at a time."""
    seq, rest = 0, b""
    while (data := file_chunk(file_id=file_id, seq=seq)) is not None:
        seq += 1
        pieces = (rest + data).split(b"\n")
        rest = pieces.pop()
        yield from pieces
    if rest:
        yield rest


class FileWriter:
    """Writes a file of lines a chunk at a time (a batch's output), in the caller's transaction."""

    def __init__(self, *, team_id: int, user_id: int, filename: str, now: datetime) -> None:
        self.file = StoredFile.objects.create(
            id=new_id("file-"),
            team_id=team_id,
            user_id=user_id,
            purpose=StoredFile.Purpose.BATCH_OUTPUT,
            filename=filename,
            created_at=now,
        )
        self.buffer = bytearray()
        self.seq = self.size = self.lines = 0

    def line(self, data: bytes) -> None:
        self.buffer += data + b"\n"
        self.lines += 1
        if len(self.buffer) >= FILE_CHUNK_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            FileChunk.objects.create(file=self.file, seq=self.seq, data=bytes(self.buffer))
            self.seq += 1
            self.size += len(self.buffer)
            self.buffer.clear()

    def close(self) -> StoredFile:
        self._flush()
        StoredFile.objects.filter(pk=self.file.pk).update(
            bytes=self.size, lines=self.lines, status=StoredFile.Status.PROCESSED
        )
        self.file.bytes, self.file.lines = self.size, self.lines
        return self.file
