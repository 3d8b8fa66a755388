from django.contrib import admin
from django.db.models import Count
from django.http import HttpRequest

from telemachus.models import Membership, Team
from telemachus.services import team_group, team_group_sync


class ReadOnlyAdmin(admin.ModelAdmin):
    """State changes go through services; the admin shows rows and offers service-backed actions."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    """Inline membership edits are followed by a group sync, so the team's auth.Group stays in step."""

    list_display = ["slug", "name", "member_count", "created_at"]
    search_fields = ["slug", "name"]
    readonly_fields = ["group", "created_at"]
    inlines = [MembershipInline]

    def get_queryset(self, request: HttpRequest):
        return super().get_queryset(request).annotate(member_total=Count("memberships"))

    @admin.display(description="members", ordering="member_total")
    def member_count(self, team: Team) -> int:
        return team.member_total

    def save_model(self, request, obj: Team, form, change: bool) -> None:
        if not change:
            obj.group = team_group(slug=obj.slug)
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change: bool) -> None:
        super().save_related(request, form, formsets, change)
        team_group_sync(team=form.instance)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["team", "user", "role", "joined_at"]
    list_filter = ["role", "team"]
    search_fields = ["team__slug", "user__username"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
