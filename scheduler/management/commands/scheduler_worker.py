import asyncio
import gc
import os
import socket

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from scheduler.connections import worker_database_settings
from scheduler.worker.runner import DEFAULT_CONCURRENCY, DEFAULT_IDLE_POLL, Worker
from telemachus.startup import startup_banner
from telemachus.tracing import tracing_setup


class Command(BaseCommand):
    help = (
        "Run a scheduler worker: claims queued jobs under the four-scope caps, dispatches them to "
        "executors, heartbeats their leases and recovers expired ones. SIGTERM drains; a second forces."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--concurrency",
            type=int,
            default=DEFAULT_CONCURRENCY,
            help=f"dispatches in flight at once (default {DEFAULT_CONCURRENCY})",
        )
        parser.add_argument("--name", default=None, help="worker name, unique per process (default host:pid)")
        parser.add_argument(
            "--burst", action="store_true", help="exit once nothing is claimable and nothing is in flight"
        )
        parser.add_argument(
            "--idle-poll",
            type=float,
            default=DEFAULT_IDLE_POLL,
            help=f"longest sleep with nothing waking the worker, seconds (default {DEFAULT_IDLE_POLL:g}): "
            "notifications, its own finishes and time-bound moments the claim names wake it",
        )
        parser.add_argument(
            "--grace",
            type=float,
            default=None,
            help="seconds to let in-flight work finish after SIGTERM before giving it back to the queue",
        )

    def handle(
        self, *args, concurrency: int, name: str | None, burst: bool, idle_poll: float, grace: float | None, **options
    ) -> None:
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        if idle_poll <= 0:
            raise CommandError("--idle-poll must be positive")
        name = name or f"{socket.gethostname()}:{os.getpid()}"
        # The banner names the database and how it is reached; a set-up that cannot serve (a pooler
        # without TELEMACHUS_PGBOUNCER) is refused here, before the loop would retry it forever.
        database = worker_database_settings(connection.settings_dict)
        self.stdout.write("\n".join(startup_banner(role=f"worker {name}", worker_database=database)))
        # OpenTelemetry traces when OTEL_EXPORTER_OTLP_ENDPOINT is set; nothing at all otherwise.
        tracing_setup(service_name="telemachus-worker")
        worker = Worker(
            name=name,
            concurrency=concurrency,
            burst=burst,
            idle_poll=idle_poll,
            grace=grace,
        )
        gc.freeze()  # what is loaded by now lives as long as the process: see telemachus/asgi.py
        asyncio.run(worker.run())
