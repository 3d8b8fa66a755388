import time

from django.core.management.base import BaseCommand, CommandParser

from scheduler.services.retention import prune_once


class Command(BaseCommand):
    help = (
        "Apply retention now, until nothing is due: finished jobs past their team's retention (with "
        "their events), prompts and answers past their body retention, ended batches and old files, "
        "ended usage windows, old audit events, webhook deliveries and executor events "
        "(docs/retention.md). The workers do the same every TELEMACHUS_PRUNE_INTERVAL_SECONDS; this is "
        "for a backlog, in the same small batches, safe while workers and API servers run."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch", type=int, default=None, help="rows per transaction (default TELEMACHUS_PRUNE_BATCH)"
        )
        parser.add_argument(
            "--pace",
            type=float,
            default=0.0,
            help="rest this many times as long as each batch took before the next (default 0: flat out; "
            "the workers use TELEMACHUS_PRUNE_PACE)",
        )

    def handle(self, *args: object, batch: int | None, pace: float, **options: object) -> None:
        began = time.monotonic()
        report = prune_once(limit=batch, pace=pace)
        took = time.monotonic() - began
        for table, n in sorted(report.counts.items()):
            self.stdout.write(f"{table}: {n}")
        self.stdout.write(f"pruned {report.total} rows in {took:.1f} s")
