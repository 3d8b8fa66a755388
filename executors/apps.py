from django.apps import AppConfig


class ExecutorsConfig(AppConfig):
    name = "executors"

    def ready(self) -> None:
        """Quota rules of the executor scope name executors: quotas, a layer below, learn of them
        here rather than importing this app."""
        from executors.models import Executor
        from quotas.models import QuotaPolicy
        from quotas.rules import subject_source_register

        subject_source_register(QuotaPolicy.Scope.EXECUTOR, Executor.objects.all, "name")
