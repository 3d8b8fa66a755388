"""Stored files and batches (docs/batches.md).

Files live in the database, in chunks of at most FILE_CHUNK_BYTES (`FileChunk`), not in a
directory: every API process and worker on any host reads the same files through the connection
it already has, with no shared volume to mount, and a batch's input, its lines and its output
are kept (and backed up, and restored) together with the jobs they became."""

import secrets

from django.conf import settings
from django.db import models
from django.db.models import Q

from telemachus.models import ApiKey, Team

# Files are written and read in pieces of this size: an upload of 200 MB is never in memory whole.
FILE_CHUNK_BYTES = 1 << 20


def new_id(prefix: str) -> str:
    """An id in the providers' shape (`file-…`, `batch_…`, `msgbatch_…`), unguessable, so that an
    id says nothing about how many others there are."""
    return f"{prefix}{secrets.token_hex(12)}"


class StoredFile(models.Model):
    """A file of the Files API: uploaded (`purpose` batch) or written by a batch (`batch_output`)."""

    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"

    class Status(models.TextChoices):
        UPLOADED = "uploaded"  # still arriving
        PROCESSED = "processed"

    id = models.CharField(primary_key=True, max_length=40)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_index=False)
    purpose = models.CharField(max_length=16, choices=Purpose.choices)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.UPLOADED)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField(default=0)
    lines = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index("team", models.F("created_at").desc(), name="storedfile_team_idx")]

    def __str__(self) -> str:
        return f"{self.id} ({self.purpose}, {self.bytes} bytes)"


class FileChunk(models.Model):
    """One piece of a file's bytes, in order of `seq`."""

    file = models.ForeignKey(StoredFile, on_delete=models.CASCADE, related_name="chunks", db_index=False)
    seq = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["file", "seq"], name="filechunk_file_seq_uniq")]


class Batch(models.Model):
    """A batch: its input checked and kept line by line (`BatchLine`), fed into the queue as jobs
    of its team by the workers (scheduler/batches/feeder.py), its output written when it ends.

    Status moves validating → in_progress → finalizing → completed | expired, or to failed (its
    input did not pass validation), or cancelling → cancelled. `fed` is how many of its lines
    have entered the queue (or were refused there); lines enter in order."""

    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    class Api(models.TextChoices):
        OPENAI = "openai"
        ANTHROPIC = "anthropic"

    id = models.CharField(primary_key=True, max_length=40)
    api = models.CharField(max_length=16, choices=Api.choices, default=Api.OPENAI)
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_index=False)
    key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    endpoint = models.CharField(max_length=64)
    input_file_id = models.CharField(max_length=40, blank=True, default="")
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)
    output_file_id = models.CharField(max_length=40, blank=True, default="")
    error_file_id = models.CharField(max_length=40, blank=True, default="")
    lines = models.PositiveIntegerField(default=0)
    fed = models.PositiveIntegerField(default=0)
    # Lines refused before they became jobs: by the input's checks, or by admission when fed.
    refused = models.PositiveIntegerField(default=0)
    # The counts when it ended (while it runs they are read from its jobs).
    counts = models.JSONField(null=True, blank=True)
    # The trace context of the request that created it (telemachus/tracing.py), which each
    # line's span links to; empty when that process did not trace (then no line is traced).
    trace = models.JSONField(default=dict, db_default={}, blank=True)
    # When retention removed its prompts and answers: its lines, its input and output files
    # (scheduler/services/retention.py).
    body_removed_at = models.DateTimeField(null=True, blank=True)
    # When it ended, however it ended (the stamp of its end is set too): retention's cut-off.
    ended_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    ACTIVE = (Status.IN_PROGRESS, Status.FINALIZING, Status.CANCELLING)
    ENDED = (Status.COMPLETED, Status.FAILED, Status.EXPIRED, Status.CANCELLED)

    class Meta:
        indexes = [
            models.Index("team", models.F("created_at").desc(), name="batch_team_idx"),
            # The feeder walks the batches under way.
            models.Index(
                "status", name="batch_active_idx", condition=Q(status__in=["in_progress", "finalizing", "cancelling"])
            ),
            # Retention picks a team's batches that ended before its cut-off, oldest first.
            models.Index(fields=["team", "ended_at"], name="batch_ended_idx", condition=Q(ended_at__isnull=False)),
            # Whether a batch under way reads a file (retention, a file's delete).
            models.Index(fields=["input_file_id"], name="batch_input_file_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.status}, {self.fed}/{self.lines})"


class BatchLine(models.Model):
    """One line of a batch's input, checked: the chat job it becomes (`requirements`, `input`),
    or why the gateway refused it (`error`, OpenAI's error object with the line's number)."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="+", db_index=False)
    line = models.PositiveIntegerField()  # 1-based, as in the input file
    custom_id = models.CharField(max_length=512)
    requirements = models.JSONField(default=dict)
    input = models.JSONField(default=dict)
    # What its answer's shape needs besides the result (the model asked for, a translated
    # protocol's context): kept in its job's meta.
    meta = models.JSONField(default=dict)
    error = models.JSONField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["batch", "line"], name="batchline_batch_line_uniq")]

    def __str__(self) -> str:
        return f"{self.batch_id} line {self.line}"
