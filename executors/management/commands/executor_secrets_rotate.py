from django.core.management.base import BaseCommand, CommandError

from executors.sealing import SecretUnreadable
from executors.services import executor_secrets_rotate


class Command(BaseCommand):
    help = (
        "Seal every executor's stored secrets again under the first key of TELEMACHUS_SECRETS_KEY (or the key "
        "derived from SECRET_KEY): run it after putting a new key first, before dropping the old one."
    )

    def handle(self, *args, **options) -> None:
        try:
            rotated = executor_secrets_rotate()
        except SecretUnreadable as exc:
            raise CommandError(f"nothing changed: {exc}") from None
        self.stdout.write(
            f"Resealed the secrets of {len(rotated)} executor(s){': ' if rotated else '.'}{', '.join(rotated)}"
        )
