from contextvars import ContextVar
from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from quotas.budget import Account, Budgets
from quotas.models import QuotaPolicy, Spend, Usage, money_text
from quotas.rules import quota_rule_errors
from quotas.services import quota_policy_create, quota_policy_delete, quota_policy_update
from telemachus.admin import ReadOnlyAdmin

_accounts: ContextVar[dict[int, Account]] = ContextVar("quota_accounts")


class QuotaPolicyForm(forms.ModelForm[QuotaPolicy]):
    class Meta:
        model = QuotaPolicy
        fields = ["scope", "subject", "dimension", "limit", "window"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if all(name in data for name in ("scope", "dimension")):
            errors = quota_rule_errors(
                scope=data["scope"],
                subject=data.get("subject", ""),
                dimension=data["dimension"],
                window=data.get("window", ""),
                exclude_pk=self.instance.pk,
            )
            for name, messages in errors.items():
                self.add_error(None if name == "non_field_errors" else name, messages)
            limit = data.get("limit")
            if limit is not None and data["dimension"] != QuotaPolicy.Dimension.COST and limit != int(limit):
                self.add_error("limit", f"A whole number for {data['dimension']} (an amount only for ai.cost).")
        return data


@admin.register(QuotaPolicy)
class QuotaPolicyAdmin(admin.ModelAdmin[QuotaPolicy]):
    """Budget rules show their usage in the current window beside the limit. Saves and deletes go
    through the quota services, so they are audited like API edits."""

    form = QuotaPolicyForm
    list_display = ["dimension", "scope", "subject", "limit", "window", "used", "remaining", "resets", "updated_at"]
    list_filter = ["dimension", "scope", "window"]
    search_fields = ["subject"]

    def save_model(self, request: HttpRequest, obj: QuotaPolicy, form: Any, change: bool) -> None:
        fields = {name: form.cleaned_data[name] for name in form.Meta.fields}
        if change:
            stored = QuotaPolicy.objects.get(pk=obj.pk)
            quota_policy_update(policy=stored, by=request.user, **fields)
        else:
            obj.pk = quota_policy_create(by=request.user, **fields).pk

    def delete_model(self, request: HttpRequest, obj: QuotaPolicy) -> None:
        quota_policy_delete(policy=obj, by=request.user)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[QuotaPolicy]) -> None:
        for policy in queryset:
            quota_policy_delete(policy=policy, by=request.user)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # Read the ledger once per page, not once per row; a context variable, because the admin
        # instance is shared by concurrent requests.
        token = _accounts.set({a.rule.pk: a for a in Budgets.load(now=timezone.now()).accounts})
        try:
            response = super().changelist_view(request, extra_context)
            if hasattr(response, "render"):
                response.render()
            return response
        finally:
            _accounts.reset(token)

    def _account(self, policy: QuotaPolicy) -> Account | None:
        return _accounts.get({}).get(policy.pk)

    @admin.display(description="used (+ reserved)")
    def used(self, policy: QuotaPolicy) -> str:
        account = self._account(policy)
        return f"{account.show(account.used)} (+{account.show(account.reserved)})" if account else "-"

    @admin.display(description="remaining")
    def remaining(self, policy: QuotaPolicy) -> str:
        account = self._account(policy)
        return str(account.show(max(account.remaining, 0))) if account else "-"

    @admin.display(description="resets")
    def resets(self, policy: QuotaPolicy) -> str:
        account = self._account(policy)
        return f"{account.end:%Y-%m-%d %H:%M} UTC" if account else "-"


@admin.register(Usage)
class UsageAdmin(ReadOnlyAdmin):
    """The ledger, read-only: it changes only through claims and finishes."""

    list_display = [
        "scope",
        "subject",
        "window",
        "window_start",
        "tokens",
        "requests",
        "reserved_tokens",
        "reserved_requests",
        "cost",
        "reserved_cost",
        "exhausted_at",
    ]
    list_filter = ["scope", "window"]
    search_fields = ["subject"]
    date_hierarchy = "window_start"


@admin.register(Spend)
class SpendAdmin(ReadOnlyAdmin):
    """The spend ledger, read-only: tokens and money per day, team, user and model."""

    list_display = ["day", "team", "user", "key", "model", "requests", "tokens", "spent"]
    list_filter = ["team", "model"]
    search_fields = ["model", "user__username", "team__slug"]
    date_hierarchy = "day"
    list_select_related = ["team", "user", "key"]

    @admin.display(description="cost", ordering="cost")
    def spent(self, row: Spend) -> str:
        return money_text(row.cost)
