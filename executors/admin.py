from django.contrib import admin
from django.db import models
from django.db.models import Count

from executors.models import Executor
from executors.services import executor_update


@admin.register(Executor)
class ExecutorAdmin(admin.ModelAdmin):
    list_display = [
        "name", "kind", "team", "enabled", "health", "breaker", "max_concurrency", "slots_in_use", "weight", "last_seen",
    ]
    list_filter = ["kind", "enabled", "health", "breaker", "team"]
    search_fields = ["name", "endpoint"]
    list_editable = ["enabled", "max_concurrency"]
    readonly_fields = [
        "health", "last_seen", "last_probed_at", "breaker", "consecutive_failures", "breaker_until", "created_at",
        "updated_at",
    ]
    actions = ["enable", "disable"]
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("team").annotate(slot_total=Count("slots"))

    @admin.display(description="in use", ordering="slot_total")
    def slots_in_use(self, executor: Executor) -> int:
        return executor.slot_total

    @admin.action(description="Enable the selected executors")
    def enable(self, request, queryset) -> None:
        for executor in queryset:
            executor_update(executor=executor, enabled=True)

    @admin.action(description="Disable the selected executors (running work finishes, nothing new is placed)")
    def disable(self, request, queryset) -> None:
        for executor in queryset:
            executor_update(executor=executor, enabled=False)
