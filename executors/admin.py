from django import forms
from django.contrib import admin
from django.db import models
from django.db.models import Count
from django.http import HttpRequest

from executors.credentials import transport_shown
from executors.models import Executor, ModelRoute
from executors.routes import route_create, route_delete, route_update
from executors.services import AUDITED, executor_create, executor_delete, executor_update


class ExecutorForm(forms.ModelForm):
    """The transport is shown with its secrets masked (executors/credentials.py); a mask saved
    back keeps the secret stored at its place, and a secret typed in is sealed by the service.
    (No Meta: the admin builds the form's fields, with its URLField options.)"""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None and "transport" in self.fields:
            self.initial["transport"] = transport_shown(self.instance.transport)


@admin.register(Executor)
class ExecutorAdmin(admin.ModelAdmin):
    """Saves (the form, the list's editable columns, the actions) and deletes go through the executor
    services, so every change is audited like an API edit. Secrets are never shown: masked in the
    form, and in the page a view-only user sees."""

    form = ExecutorForm

    list_display = [
        "name",
        "kind",
        "team",
        "enabled",
        "health",
        "breaker",
        "max_concurrency",
        "slots_in_use",
        "weight",
        "last_seen",
    ]
    list_filter = ["kind", "enabled", "health", "breaker", "team"]
    search_fields = ["name", "endpoint"]
    list_editable = ["enabled", "max_concurrency"]
    readonly_fields = [
        "health",
        "last_seen",
        "last_probed_at",
        "breaker",
        "consecutive_failures",
        "breaker_until",
        "created_at",
        "updated_at",
    ]
    actions = ["enable", "disable"]
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("team").annotate(slot_total=Count("slots"))

    def get_exclude(self, request: HttpRequest, obj: Executor | None = None):
        # A view-only page shows fields as they are stored: the masked transport instead.
        if obj is not None and not self.has_change_permission(request, obj):
            return ["transport"]
        return super().get_exclude(request, obj)

    def get_readonly_fields(self, request: HttpRequest, obj: Executor | None = None):
        readonly = list(super().get_readonly_fields(request, obj))
        if obj is not None and not self.has_change_permission(request, obj):
            readonly.append("shown_transport")
        return readonly

    @admin.display(description="transport")
    def shown_transport(self, executor: Executor) -> dict:
        return transport_shown(executor.transport)

    @admin.display(description="in use", ordering="slot_total")
    def slots_in_use(self, executor: Executor) -> int:
        return executor.slot_total  # type: ignore[attr-defined]

    @admin.action(description="Enable the selected executors")
    def enable(self, request, queryset) -> None:
        for executor in queryset:
            executor_update(executor=executor, by=request.user, enabled=True)

    @admin.action(description="Disable the selected executors (running work finishes, nothing new is placed)")
    def disable(self, request, queryset) -> None:
        for executor in queryset:
            executor_update(executor=executor, by=request.user, enabled=False)

    def save_model(self, request, obj: Executor, form, change: bool) -> None:
        fields = {name: form.cleaned_data[name] for name in form.changed_data if name in AUDITED}
        if change:
            executor_update(executor=Executor.objects.select_related("team").get(pk=obj.pk), by=request.user, **fields)
        else:
            fields = {name: form.cleaned_data[name] for name in AUDITED if name in form.cleaned_data}
            obj.pk = executor_create(by=request.user, **fields).pk

    def delete_model(self, request, obj: Executor) -> None:
        executor_delete(executor=obj, by=request.user)

    def delete_queryset(self, request, queryset) -> None:
        for executor in queryset.select_related("team"):
            executor_delete(executor=executor, by=request.user)


@admin.register(ModelRoute)
class ModelRouteAdmin(admin.ModelAdmin):
    """Saves and deletes go through the route services (executors/routes.py): audited like an API edit."""

    list_display = ("name", "models_shown", "updated_at")
    search_fields = ("name",)

    @admin.display(description="models, in order")
    def models_shown(self, route: ModelRoute) -> str:
        return " → ".join(route.models)

    def save_model(self, request, obj: ModelRoute, form, change: bool) -> None:
        if change:
            fields = {name: form.cleaned_data[name] for name in form.changed_data if name in ("name", "models")}
            route_update(route=ModelRoute.objects.get(pk=obj.pk), by=request.user, **fields)
        else:
            obj.pk = route_create(name=obj.name, models=obj.models, by=request.user).pk

    def delete_model(self, request, obj: ModelRoute) -> None:
        route_delete(route=obj, by=request.user)

    def delete_queryset(self, request, queryset) -> None:
        for route in queryset:
            route_delete(route=route, by=request.user)
