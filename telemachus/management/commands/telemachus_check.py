"""`manage.py telemachus_check`: the configuration in force and whether it can serve production.

Prints every setting the environment gives (its value, secrets as `(secret set)`, URLs without
their password, and whether it came from the environment or is the default), then checks them
(telemachus/deployment.py): Django's `check --deploy`, the database reached as the settings say
(directly, or through a pooler with TELEMACHUS_PGBOUNCER and LISTEN straight to PostgreSQL),
migrations applied, Redis answering when set, SECRET_KEY, ALLOWED_HOSTS, the TLS settings together,
static files collected. Exit status 1 when any check finds a problem, 0 otherwise (warnings
included), so a deploy script can run it before it switches traffic."""

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from telemachus.deployment import deployment_findings

LEVELS = {"ok": "ok", "warning": "warning", "problem": "PROBLEM"}


class Command(BaseCommand):
    help = "Print the configuration in force and check it for production; exit 1 on a problem."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--checks-only", action="store_true", help="leave out the list of settings")

    def handle(self, *args: Any, checks_only: bool, **options: Any) -> None:
        if not checks_only:
            self.stdout.write(f"Configuration in force (settings module {settings.SETTINGS_MODULE}):")
            width = max(len(s.name) for s in settings.ENVIRONMENT_READ)
            for setting in settings.ENVIRONMENT_READ:
                self.stdout.write(f"  {setting.name:<{width}}  {setting.shown}  [{setting.source}]")
            self.stdout.write("")
        self.stdout.write("Checks:")
        findings = deployment_findings()
        width = max(len(f.topic) for f in findings)
        for finding in findings:
            line = f"  {LEVELS[finding.level]:<7}  {finding.topic:<{width}}  {finding.text}"
            style = {"ok": self.style.SUCCESS, "warning": self.style.WARNING}.get(finding.level, self.style.ERROR)
            self.stdout.write(style(line))
        problems = sum(f.level == "problem" for f in findings)
        warnings = sum(f.level == "warning" for f in findings)
        self.stdout.write(f"{problems} problem{'s' * (problems != 1)}, {warnings} warning{'s' * (warnings != 1)}")
        if problems:
            raise SystemExit(1)
