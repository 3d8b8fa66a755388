from django.conf import settings
from django.contrib.auth.models import Group
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.utils import timezone


class Team(models.Model):
    """A tenant. Backed by an `auth.Group` so guardian group permissions granted to the team apply
    to every member; membership (with a role) is kept in `Membership` and mirrored in the group."""

    group = models.OneToOneField(Group, on_delete=models.PROTECT, related_name="team")
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    # Retention (docs/retention.md): hours a finished job of the team is kept, and hours its prompt
    # and answer are kept (0: removed as soon as it ends); empty: TELEMACHUS_RETENTION_HOURS, and
    # the job's own retention.
    retention_hours = models.FloatField(null=True, blank=True)
    body_retention_hours = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["slug"]
        # Granted as guardian object permissions on a team (to its group, or to single users), or
        # globally; see telemachus/teams/rbac.py for which job types need which.
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
    transaction of every write to a configuration table (telemachus/control/config.py, and the migrations
    that watch each table); no Python code writes it."""

    SINGLETON_ID = 1

    version = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.CheckConstraint(condition=models.Q(id=1), name="configversion_singleton")]

    def __str__(self) -> str:
        return f"configuration version {self.version}"


class AuditEvent(models.Model):
    """Append-only log of what people changed: who (and through which surface), when, on what, and
    the fields' values before and after. It lives in the lowest app so every layer can write it in
    the transaction of the change it describes (executors and quotas may not import scheduler).
    Written only by telemachus.control.audit.audit_record; job lifecycle events stay in JobEvent."""

    class Source(models.TextChoices):
        API = "api"
        ADMIN = "admin"
        DASHBOARD = "dashboard"
        WEB = "web"
        SSO = "sso", "single sign-on"
        SYSTEM = "system"

    at = models.DateTimeField(default=timezone.now)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept when the user is deleted; "" for changes made by the system (commands, migrations).
    actor_name = models.CharField(max_length=150, blank=True, default="")
    source = models.CharField(max_length=16, choices=Source.choices, default=Source.SYSTEM)
    action = models.CharField(max_length=64)
    object_type = models.CharField(max_length=32)
    object_id = models.CharField(max_length=150, blank=True, default="")
    object_repr = models.CharField(max_length=200, blank=True, default="")
    before = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)
    after = models.JSONField(null=True, blank=True, encoder=DjangoJSONEncoder)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index("object_type", "object_id", "id", name="audit_object_idx"),
            models.Index("actor_name", "id", name="audit_actor_idx"),
            models.Index("at", name="audit_at_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.object_type}:{self.object_id} by {self.actor_name or 'system'}"


class FeatureSwitch(models.Model):
    """Turns a feature (a job kind, or the OpenAI-compatible endpoint) on or off, for everyone
    (team NULL) or for one team, which overrides the global switch. No row: on."""

    class Feature(models.TextChoices):
        CHAT = "chat"
        TRANSLATE = "translate"
        TOOL = "tool"
        TASK = "task"
        FLOW = "flow"
        OPENAI = "openai", "OpenAI-compatible endpoint"

    feature = models.CharField(max_length=16, choices=Feature.choices)
    team = models.ForeignKey(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="feature_switches")
    enabled = models.BooleanField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["feature", "team"]
        constraints = [
            models.UniqueConstraint(
                fields=["feature"], condition=models.Q(team__isnull=True), name="featureswitch_unique_global"
            ),
            models.UniqueConstraint(
                fields=["feature", "team"], condition=models.Q(team__isnull=False), name="featureswitch_unique_team"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.feature} {'on' if self.enabled else 'off'} for {self.team or 'everyone'}"


class ExternalIdentity(models.Model):
    """A user as an OpenID Connect provider knows them: the issuer and the subject (`sub`) it signs
    for them. Sign-in finds the user by this pair only, never by email or username, so nobody
    becomes a local user (the break-glass admin included) by claiming their address or name."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="external_identities")
    issuer = models.CharField(max_length=255)
    subject = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)
    last_signed_in_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["issuer", "subject"], name="externalidentity_unique")]

    def __str__(self) -> str:
        return f"{self.subject} at {self.issuer} ({self.user})"


# Credentials and webhooks live in modules of their own; imported here so Django registers them with
# this app.
from telemachus.keys.models import ApiKey, PersonalToken  # noqa: E402
from telemachus.webhooks.models import Webhook, WebhookAttempt, WebhookDelivery  # noqa: E402

__all__ = [
    "ApiKey",
    "AuditEvent",
    "ConfigVersion",
    "ExternalIdentity",
    "FeatureSwitch",
    "Membership",
    "PersonalToken",
    "Team",
    "Webhook",
    "WebhookAttempt",
    "WebhookDelivery",
]
