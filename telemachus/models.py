from django.conf import settings
from django.contrib.auth.models import Group
from django.db import models


class Team(models.Model):
    """A tenant. Backed by an `auth.Group` so guardian group permissions granted to the team apply
    to every member; membership (with a role) is kept in `Membership` and mirrored in the group."""

    group = models.OneToOneField(Group, on_delete=models.PROTECT, related_name="team")
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]
        # Granted as guardian object permissions on a team (to its group, or to single users), or
        # globally; see telemachus/rbac.py for which job types need which.
        permissions = [
            ("use_chat", "chat:use (chat and translate jobs)"),
            ("invoke_tools", "tools:invoke (tool jobs)"),
            ("run_flows", "flows:run (flow and task jobs)"),
        ]

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    class Role(models.TextChoices):
        MEMBER = "member"
        MANAGER = "manager"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    joined_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="membership_unique_team_user")]
        ordering = ["team", "user"]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class ConfigVersion(models.Model):
    """One row whose `version` moves whenever configuration changes. Database triggers bump it in the
    transaction of every write to a configuration table (telemachus/config.py, and the migrations
    that watch each table); no Python code writes it."""

    SINGLETON_ID = 1

    version = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.CheckConstraint(condition=models.Q(id=1), name="configversion_singleton")]

    def __str__(self) -> str:
        return f"configuration version {self.version}"
