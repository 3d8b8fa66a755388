"""A sampler of live slots per scope, for tests that check caps in the database while workers run."""

import threading
from collections import Counter

from django.db import connection

from scheduler.core.selectors import slot_counts


class SlotSampler(threading.Thread):
    """Samples live slots per scope from the database, on its own connection, and keeps peaks."""

    def __init__(self, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.stop = threading.Event()
        self.peak_total = 0
        self.peak = {"executor": Counter(), "team": Counter(), "user": Counter(), "batch": Counter()}
        self.samples = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                counts = slot_counts()
                self.samples += 1
                self.peak_total = max(self.peak_total, counts.total)
                for scope in self.peak:
                    for key, n in getattr(counts, scope).items():
                        self.peak[scope][key] = max(self.peak[scope][key], n)
                self.stop.wait(self.interval)
        finally:
            connection.close()

    def __enter__(self) -> "SlotSampler":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()
