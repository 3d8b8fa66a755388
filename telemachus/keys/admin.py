"""The admin's pages for API keys and personal tokens (registered from telemachus/admin.py).

A secret appears once: on the page that answers the form that created it, rendered straight into
that response (no redirect, so it goes through no session, message store or log) with
`Cache-Control: no-store`. Every other page shows prefixes only; there is nothing else to show.
Creating and revoking go through the key services, so they are audited like API calls;
they are for operators (a team's managers use the API)."""

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse

from telemachus.keys.models import ApiKey, PersonalToken
from telemachus.keys.services import (
    api_key_create,
    api_key_revoke,
    personal_token_issue,
    personal_tokens_revoke,
)
from telemachus.teams import rbac

_SECRET = "_telemachus_new_secret"


class SecretOnceAdmin(admin.ModelAdmin):
    """Adds through a service that returns a secret; the add's response shows it, once."""

    usage = ""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return rbac.is_operator(request.user)  # type: ignore[arg-type]

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def response_add(self, request: HttpRequest, obj: Any, post_url_continue: str | None = None) -> HttpResponse:
        opts = self.model._meta
        response = TemplateResponse(
            request,
            "admin/telemachus/secret_created.html",
            {
                **self.admin_site.each_context(request),
                "title": f"New {opts.verbose_name}",
                "opts": opts,
                "object": obj,
                "secret": getattr(request, _SECRET),
                "usage": self.usage,
                "changelist_url": reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"),
            },
        )
        response["Cache-Control"] = "no-store"
        return response


class ApiKeyForm(forms.ModelForm):
    models_text = forms.CharField(
        label="Models",
        required=False,
        help_text="Comma-separated model names the key may call; empty: every model its team may use.",
    )

    class Meta:
        model = ApiKey
        fields = ["team", "name", "expires_at"]


@admin.register(ApiKey)
class ApiKeyAdmin(SecretOnceAdmin):
    form = ApiKeyForm
    usage = "Apps send it as 'Authorization: Bearer <key>' to /v1/ (any OpenAI SDK: api_key=...) and /api/."
    list_display = [
        "prefix",
        "name",
        "team",
        "model_list",
        "created_by",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["team", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "prefix", "team__slug"]
    readonly_fields = [
        "prefix",
        "name",
        "team",
        "model_list",
        "principal",
        "created_by",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
        "revoked_by",
    ]
    actions = ["revoke"]

    def get_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:  # type: ignore[override]
        return ["team", "name", "models_text", "expires_at"] if obj is None else list(self.readonly_fields)

    def get_readonly_fields(self, request: HttpRequest, obj: ApiKey | None = None) -> list[str]:
        return [] if obj is None else list(self.readonly_fields)

    @admin.display(description="models")
    def model_list(self, key: ApiKey) -> str:
        return ", ".join(key.allowed_models) or "(all of the team's)"

    def save_model(self, request: HttpRequest, obj: ApiKey, form: forms.ModelForm, change: bool) -> None:
        models = [m.strip() for m in form.cleaned_data.get("models_text", "").split(",") if m.strip()]
        key, secret = api_key_create(
            team=form.cleaned_data["team"],
            name=form.cleaned_data["name"],
            models=models,
            expires_at=form.cleaned_data.get("expires_at"),
            by=request.user,
        )
        setattr(request, _SECRET, secret)
        obj.pk, obj.prefix, obj.principal = key.pk, key.prefix, key.principal

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request: HttpRequest, queryset: Any) -> None:
        if not rbac.is_operator(request.user):  # type: ignore[arg-type]
            self.message_user(request, "Only operators revoke keys here.", messages.ERROR)
            return
        for key in queryset.select_related("team"):
            api_key_revoke(key=key, by=request.user)  # type: ignore[arg-type]

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        if not rbac.is_operator(request.user):  # type: ignore[arg-type]
            actions.pop("revoke", None)
        return actions


class PersonalTokenForm(forms.ModelForm):
    class Meta:
        model = PersonalToken
        fields = ["user", "name"]


@admin.register(PersonalToken)
class PersonalTokenAdmin(SecretOnceAdmin):
    form = PersonalTokenForm
    usage = "Send it as 'Authorization: Token <token>' (or Bearer) to /api/ and /v1/."
    list_display = ["prefix", "user", "name", "created_at", "last_used_at"]
    search_fields = ["user__username", "name", "prefix"]
    readonly_fields = ["prefix", "user", "name", "created_at", "last_used_at"]
    autocomplete_fields = ["user"]

    def get_fields(self, request: HttpRequest, obj: PersonalToken | None = None) -> list[str]:  # type: ignore[override]
        return ["user", "name"] if obj is None else list(self.readonly_fields)

    def get_readonly_fields(self, request: HttpRequest, obj: PersonalToken | None = None) -> list[str]:
        return [] if obj is None else list(self.readonly_fields)

    def save_model(self, request: HttpRequest, obj: PersonalToken, form: forms.ModelForm, change: bool) -> None:
        token, secret = personal_token_issue(
            user=form.cleaned_data["user"], name=form.cleaned_data.get("name") or "admin", by=request.user
        )
        setattr(request, _SECRET, secret)
        obj.pk, obj.prefix = token.pk, token.prefix

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return rbac.is_operator(request.user)  # type: ignore[arg-type]

    def delete_model(self, request: HttpRequest, obj: PersonalToken) -> None:
        personal_tokens_revoke(tokens=[obj], by=request.user)  # type: ignore[arg-type]

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        personal_tokens_revoke(tokens=list(queryset.select_related("user")), by=request.user)  # type: ignore[arg-type]
