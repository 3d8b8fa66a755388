import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from executors.models import Executor
from telemachus.models import Team
from telemachus.teams import rbac
from telemachus.teams.services import team_create, team_member_set


class Command(BaseCommand):
    help = (
        "Seed a demo: team `demo`, a `sim` executor offering model `sim`, a `cpu-node` executor `cpu` "
        "offering `cpu` (for task jobs and Django tasks), and an `admin` superuser "
        "(its password is printed once, when it is created). Safe to run again: it creates only what is missing."
    )

    def handle(self, *args, **options) -> None:
        User = get_user_model()
        with transaction.atomic():
            password = None
            admin = User.objects.filter(username="admin").first()
            if admin is None:
                password = secrets.token_urlsafe(12)
                admin = User.objects.create_superuser("admin", "admin@localhost", password)
            team = Team.objects.filter(slug="demo").first() or team_create(
                slug="demo", name="Demo team", grants=list(rbac.PERMISSIONS)
            )
            team_member_set(team=team, username="admin", role="manager")
            _, created = Executor.objects.get_or_create(
                name="sim",
                defaults={
                    "kind": "sim",
                    "capabilities": {"models": ["sim"], "class": "cpu", "embeddings": True},
                    "max_concurrency": 8,
                    "meta": {"latency_ms": 300, "jitter_ms": 100, "output_tokens": 24},
                },
            )
            _, cpu_created = Executor.objects.get_or_create(
                name="cpu",
                defaults={
                    "kind": "cpu-node",
                    "capabilities": {"models": ["cpu"], "class": "cpu"},
                    "max_concurrency": 2,
                },
            )
        self.stdout.write(
            f"demo team: {team.slug}; sim executor: {'created' if created else 'present'}; "
            f"cpu executor: {'created' if cpu_created else 'present'}"
        )
        if password:
            self.stdout.write(self.style.WARNING(f"admin user created; password (shown once): {password}"))
        else:
            self.stdout.write("admin user present (reset its password with: python manage.py changepassword admin)")
