"""Credentials: API keys for apps (one team each) and personal API tokens (one user each).

Neither table holds a secret. Each row keeps a keyed digest of its secret (telemachus/keys/digests.py)
and a short display prefix, so a leaked database, backup, page or log lets nobody call the API."""

from django.conf import settings
from django.db import models
from django.db.models import Q

from telemachus.models import Team


class ApiKey(models.Model):
    """A key an app authenticates with. It acts for its team through a user of its own,
    `principal` (username `key:<id>`, a plain member of the team, no password): jobs it submits
    belong to the team and that user, and the `key` quota scope (subject: the key's id) counts
    them. Revoked or expired keys authenticate
    nobody; rows are never deleted, so jobs and the audit log keep naming them."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    # The start of the secret (its `tm-` marker and a few random characters), to tell keys apart.
    prefix = models.CharField(max_length=16)
    digest = models.CharField(max_length=64, unique=True)
    # The models it may call (the API's `models`); empty: every model its team may use.
    allowed_models = models.JSONField(default=list, blank=True)
    principal = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="api_key", null=True, blank=True
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    revoked_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        verbose_name = "API key"
        ordering = ["team", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["team", "name"], condition=Q(revoked_at__isnull=True), name="apikey_unique_live_name"
            )
        ]

    def __str__(self) -> str:
        return f"{self.prefix}… {self.name} ({self.team})"


class PersonalToken(models.Model):
    """A person's API token (`Authorization: Token …` or `Bearer …`): it acts as its user, with
    everything the user may do. Issued by `drf_create_token`, `POST /api/users/` or the admin;
    a user may hold several (one per machine or script), each revoked on its own."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True, default="")
    prefix = models.CharField(max_length=16)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "personal API token"
        ordering = ["user", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… of {self.user}"
