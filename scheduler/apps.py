from importlib import import_module
from typing import Any

from django.apps import AppConfig
from django.db import connections
from django.db.models.signals import post_migrate


class SchedulerConfig(AppConfig):
    name = "scheduler"

    def ready(self) -> None:
        """Install what the lower layers report through: they never import the scheduler."""
        from executors import health
        from scheduler.batches.output import shapes_loader_install
        from scheduler.services.cancel import key_jobs_cancel
        from scheduler.services.events import executor_events_record
        from telemachus.keys.services import api_key_revoke_hook_register

        health.events_recorder_install(executor_events_record)
        api_key_revoke_hook_register(key_jobs_cancel)
        # How batch lines' answers read, for the workers that write them: the gateway's dialects,
        # imported when a batch's files are first written, not at every process's start.
        shapes_loader_install(lambda: import_module("scheduler.gateway.batches.shapes").shapes_register())
        post_migrate.connect(_queue_tally_triggers_ensure, sender=self, dispatch_uid="scheduler.queue_tally_triggers")


def _queue_tally_triggers_ensure(*, using: str, plan: Any = None, **_: Any) -> None:
    """After a migrate that applied anything: the queue tally's SQLite triggers, which a table
    rebuild of scheduler_job drops (scheduler/migrations/0018_queue_tally_everywhere.py)."""
    if plan:
        tally = import_module("scheduler.migrations.0018_queue_tally_everywhere")
        tally.triggers_ensure(connections[using])
