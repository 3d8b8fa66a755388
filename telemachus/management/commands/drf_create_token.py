"""`manage.py drf_create_token USER`: DRF's command, for tokens that are stored hashed.

DRF's own command prints the user's existing token; a hashed token cannot be printed again, so
this one issues a new token every time (earlier ones keep working; `--reset` revokes them first)
and prints it in DRF's words, so `drf_create_token admin | awk '{print $3}'` still gives a
usable token. The token is printed here only: it is stored as a digest."""

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from telemachus.keys.models import PersonalToken
from telemachus.keys.services import personal_token_issue, personal_tokens_revoke


class Command(BaseCommand):
    help = "Issue an API token for a user (printed once; only its digest is stored)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", type=str)
        parser.add_argument(
            "-r",
            "--reset",
            action="store_true",
            dest="reset_token",
            default=False,
            help="Revoke the user's existing tokens before issuing the new one.",
        )
        parser.add_argument("--name", default="drf_create_token", help="What the token is for (shown in the admin).")

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["username"]
        try:
            user = get_user_model()._default_manager.get_by_natural_key(username)
        except get_user_model().DoesNotExist:
            raise CommandError(f"Cannot create the Token: user {username} does not exist") from None
        if options["reset_token"]:
            personal_tokens_revoke(tokens=list(PersonalToken.objects.filter(user=user).select_related("user")))
        _, secret = personal_token_issue(user=user, name=options["name"])  # type: ignore[arg-type]
        self.stdout.write(f"Generated token {secret} for user {username}")
