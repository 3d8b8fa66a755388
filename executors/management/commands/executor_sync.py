from django.core.management.base import BaseCommand, CommandError, CommandParser

from executors.models import Executor
from executors.services import executor_sync
from telemachus.errors import DomainError


class Command(BaseCommand):
    help = "Read the models each model-server executor serves (GET {endpoint}/models) into capabilities.models."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", nargs="?", help="one executor; default: every enabled model-server executor")

    def handle(self, *args, name: str | None, **options) -> None:
        if name:
            executors = list(Executor.objects.filter(name=name))
            if not executors:
                raise CommandError(f"No executor named {name!r}.")
        else:
            executors = list(Executor.objects.filter(enabled=True, kind__in=["local-model", "remote-model"]))
        failed = 0
        for executor in executors:
            try:
                synced = executor_sync(executor=executor)
            except DomainError as exc:
                failed += 1
                self.stderr.write(f"{executor.name}: {exc.detail}")
                continue
            self.stdout.write(f"{synced.name}: {', '.join(synced.offered_models) or '(no models)'}")
        if failed:
            raise CommandError(f"{failed} executor(s) could not be synced.")
