from django import forms
from django.contrib import admin
from django.db.models import Count
from django.http import HttpRequest

from telemachus.control.features import feature_set
from telemachus.models import AuditEvent, FeatureSwitch, Membership, Team
from telemachus.teams import rbac
from telemachus.teams.services import team_create, team_delete, team_member_remove, team_member_set, team_update


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

    def get_queryset(self, request: HttpRequest):
        # API keys' users are the keys' to manage (the API keys page), not the team form's.
        return super().get_queryset(request).exclude(user__username__startswith=rbac.KEY_PRINCIPAL_PREFIX)


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    """Every save goes through the team services (so the team's auth.Group stays in step with its
    members, and each change is audited like an API edit): the inline's rows are read as the
    members the team should have, and the difference is applied member by member."""

    list_display = ["slug", "name", "member_count", "created_at"]
    search_fields = ["slug", "name"]
    readonly_fields = ["group", "created_at"]
    inlines = [MembershipInline]

    def get_queryset(self, request: HttpRequest):
        return super().get_queryset(request).annotate(member_total=Count("memberships"))

    @admin.display(description="members", ordering="member_total")
    def member_count(self, team: Team) -> int:
        return team.member_total  # type: ignore[attr-defined]

    def save_model(self, request, obj: Team, form, change: bool) -> None:
        if change:
            team_update(
                team=Team.objects.get(pk=obj.pk),
                name=obj.name,
                retention_hours=obj.retention_hours,
                body_retention_hours=obj.body_retention_hours,
                by=request.user,
            )
        else:
            team = team_create(slug=obj.slug, name=obj.name, by=request.user)
            obj.pk, obj.group, obj.created_at = team.pk, team.group, team.created_at

    def save_formset(self, request, form, formset, change: bool) -> None:
        team = form.instance
        wanted = {
            row.cleaned_data["user"]: row.cleaned_data["role"]
            for row in formset.forms
            if row.cleaned_data.get("user") and not row.cleaned_data.get("DELETE")
        }
        for membership in team.memberships.select_related("user"):
            if membership.user not in wanted and not rbac.is_key_principal(membership.user):
                team_member_remove(team=team, user=membership.user, by=request.user)
        for user, role in wanted.items():
            team_member_set(team=team, username=user.get_username(), role=role, by=request.user)
        formset.new_objects, formset.changed_objects, formset.deleted_objects = [], [], []

    def delete_model(self, request, obj: Team) -> None:
        team_delete(team=obj, by=request.user)

    def delete_queryset(self, request, queryset) -> None:
        for team in queryset:
            team_delete(team=team, by=request.user)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["team", "user", "role", "joined_at"]
    list_filter = ["role", "team"]
    search_fields = ["team__slug", "user__username"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    """The audit log, read-only: rows are written by the services that make the changes."""

    list_display = ["at", "actor_name", "source", "action", "object_type", "object_id", "object_repr"]
    list_filter = ["source", "object_type", "action"]
    search_fields = ["actor_name", "object_id", "object_repr", "action"]
    date_hierarchy = "at"
    readonly_fields = [
        "at",
        "actor",
        "actor_name",
        "source",
        "action",
        "object_type",
        "object_id",
        "object_repr",
        "before",
        "after",
    ]

    def has_view_permission(self, request: HttpRequest, obj=None) -> bool:
        return rbac.is_operator(request.user)


class FeatureSwitchForm(forms.ModelForm):
    class Meta:
        model = FeatureSwitch
        fields = ["feature", "team", "enabled"]


@admin.register(FeatureSwitch)
class FeatureSwitchAdmin(admin.ModelAdmin):
    """Switches saved and deleted through feature_set, so they are audited like API edits. A team's
    row overrides the global one (no team); deleting a team's row makes it follow the global one."""

    form = FeatureSwitchForm
    list_display = ["feature", "team", "enabled", "updated_at"]
    list_filter = ["feature", "enabled", "team"]
    list_editable = ["enabled"]

    def save_model(self, request: HttpRequest, obj: FeatureSwitch, form, change: bool) -> None:
        if change and {"feature", "team"} & set(form.changed_data):
            stored = FeatureSwitch.objects.select_related("team").get(pk=obj.pk)
            self.delete_model(request, stored)
        feature_set(feature=obj.feature, team=obj.team, enabled=obj.enabled, by=request.user)
        obj.pk = FeatureSwitch.objects.get(feature=obj.feature, team=obj.team).pk

    def delete_model(self, request: HttpRequest, obj: FeatureSwitch) -> None:
        if obj.team is None:  # the global switch's "no row" is on
            feature_set(feature=obj.feature, team=None, enabled=True, by=request.user)
            FeatureSwitch.objects.filter(pk=obj.pk).delete()
        else:
            feature_set(feature=obj.feature, team=obj.team, enabled=None, by=request.user)

    def delete_queryset(self, request: HttpRequest, queryset) -> None:
        for switch in queryset.select_related("team"):
            self.delete_model(request, switch)


from telemachus.keys import admin as keys_admin  # noqa: E402,F401  (registers API keys and personal tokens)
