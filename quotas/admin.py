from django import forms
from django.contrib import admin

from quotas.models import QuotaPolicy
from quotas.rules import quota_rule_errors


class QuotaPolicyForm(forms.ModelForm):
    class Meta:
        model = QuotaPolicy
        fields = ["scope", "subject", "dimension", "limit", "window"]

    def clean(self) -> dict:
        data = super().clean()
        if all(name in data for name in ("scope", "dimension")):
            errors = quota_rule_errors(
                scope=data["scope"], subject=data.get("subject", ""), dimension=data["dimension"],
                window=data.get("window", ""), exclude_pk=self.instance.pk,
            )
            for name, messages in errors.items():
                self.add_error(None if name == "non_field_errors" else name, messages)
        return data


@admin.register(QuotaPolicy)
class QuotaPolicyAdmin(admin.ModelAdmin):
    form = QuotaPolicyForm
    list_display = ["dimension", "scope", "subject", "limit", "window", "updated_at"]
    list_filter = ["dimension", "scope", "window"]
    search_fields = ["subject"]
