from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"

    def ready(self) -> None:
        """Install what the lower layers report through: they never import the scheduler."""
        from executors import health
        from scheduler.services.events import executor_events_record

        health.events_recorder_install(executor_events_record)
