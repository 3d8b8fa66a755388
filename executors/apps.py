from typing import Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error, register

from executors.sealing import sealing_problem


class ExecutorsConfig(AppConfig):
    name = "executors"

    def ready(self) -> None:
        register(sealing_key_check)


def sealing_key_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A malformed TELEMACHUS_SECRETS_KEY stops `manage.py` commands at start (workers, migrate)
    rather than the first dispatch that needs a secret."""
    problem = sealing_problem()
    return [Error(problem, id="executors.E001")] if problem else []
