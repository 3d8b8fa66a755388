from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"

    def ready(self) -> None:
        """Install what the lower layers report through: they never import the scheduler."""
        from executors import health
        from scheduler.services.cancel import key_jobs_cancel
        from scheduler.services.events import executor_events_record
        from telemachus.keys.services import api_key_revoke_hook_register

        health.events_recorder_install(executor_events_record)
        api_key_revoke_hook_register(key_jobs_cancel)
