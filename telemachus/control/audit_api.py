"""GET /api/audit/: the audit log, for operators, newest first, filtered by actor, object and time."""

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from telemachus.models import AuditEvent
from telemachus.teams import rbac


class AuditFilter(serializers.Serializer):
    actor = serializers.CharField(required=False, help_text="Username; `system` for changes without a person.")
    action = serializers.CharField(required=False, help_text="Exact action (`executor.update`) or its object type.")
    object_type = serializers.CharField(required=False)
    object_id = serializers.CharField(required=False)
    source = serializers.ChoiceField(choices=AuditEvent.Source.choices, required=False)  # type: ignore[assignment]
    since = serializers.DateTimeField(required=False, help_text="ISO 8601; events at or after.")
    until = serializers.DateTimeField(required=False, help_text="ISO 8601; events before.")


class AuditEventOutput(serializers.ModelSerializer):
    actor = serializers.SerializerMethodField()

    class Meta:
        model = AuditEvent
        fields = ["id", "at", "actor", "source", "action", "object_type", "object_id", "object_repr", "before", "after"]
        read_only_fields = fields

    def get_actor(self, event: AuditEvent) -> str | None:
        return event.actor_name or None


class AuditListApi(ListAPIView):
    """Every operator action (API, admin, dashboard) with who, when, before and after. Cursor
    paginated, newest first; operators only."""

    serializer_class = AuditEventOutput
    filter_serializer = AuditFilter

    @extend_schema(parameters=[AuditFilter])
    def get(self, request: Request, *args, **kwargs) -> Response:
        return super().get(request, *args, **kwargs)

    def get_queryset(self) -> QuerySet[AuditEvent]:
        rbac.require_operator(self.request.user)
        filters = AuditFilter(data=self.request.query_params)
        filters.is_valid(raise_exception=True)
        wanted = filters.validated_data
        events = AuditEvent.objects.all()
        if "actor" in wanted:
            events = events.filter(actor_name="" if wanted["actor"] == "system" else wanted["actor"])
        if "action" in wanted:
            action = wanted["action"]
            events = events.filter(action=action) if "." in action else events.filter(action__startswith=f"{action}.")
        for name in ("object_type", "object_id", "source"):
            if name in wanted:
                events = events.filter(**{name: wanted[name]})
        if "since" in wanted:
            events = events.filter(at__gte=wanted["since"])
        if "until" in wanted:
            events = events.filter(at__lt=wanted["until"])
        return events
