"""`manage.py telemachus_admin --username NAME [--email ADDRESS]`: the first administrator of a
production instance, without the demo (`telemachus_demo` adds a team and executors a production
instance does not want).

Non-interactive, for a deploy script: the password is generated and printed once, on stdout, as
`password (shown once): ...`; only its hash is stored. Why generated rather than read from an
environment variable (as Django's `createsuperuser --noinput` reads DJANGO_SUPERUSER_PASSWORD):
a password in the environment sits in the unit file or the script that sets it, in shell history,
and in /proc/PID/environ of the process and of whatever it starts, long after it was needed; a
generated one is strong by construction and exists only in this command's output, which the
operator stores in their password manager and changes at will (`manage.py changepassword NAME`).

Safe to run again: an existing administrator of that name is left as it is (nothing printed but
that it exists, exit 0); an existing user who is not one is refused (exit 1), never promoted."""

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from telemachus.teams.users import administrator_create


class Command(BaseCommand):
    help = "Create the first administrator (a superuser) with a generated password, printed once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--username", required=True)
        parser.add_argument("--email", default="")

    def handle(self, *args: Any, username: str, email: str, **options: Any) -> None:
        existing = get_user_model().objects.filter(username=username).first()
        if existing is not None:
            if not existing.is_superuser:
                raise CommandError(f"user {username!r} exists and is not an administrator; choose another username")
            self.stdout.write(
                f"administrator {username!r} exists; left as it is (new password: manage.py changepassword {username})"
            )
            return
        _, password = administrator_create(username=username, email=email, by=None)
        self.stdout.write(f"administrator {username!r} created; password (shown once): {password}")
        self.stdout.write(f"sign in at /admin/ or /dashboard/; change it with: manage.py changepassword {username}")
