from django.contrib import admin
from django.db import models
from django.db.models import Count

from executors.models import Executor
from executors.services import AUDITED, executor_create, executor_delete, executor_update


@admin.register(Executor)
class ExecutorAdmin(admin.ModelAdmin):
    """Saves (the form, the list's editable columns, the actions) and deletes go through the executor
    services, so every change is audited like an API edit."""

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
