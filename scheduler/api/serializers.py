from typing import Any

from rest_framework import serializers

from scheduler.models import Job, JobEvent
from scheduler.services.submit import MAX_BULK
from telemachus.serializers import StrictSerializer

MESSAGE_ROLES = ("system", "user", "assistant", "tool", "developer")


class MessageInput(serializers.Serializer):
    role = serializers.ChoiceField(choices=MESSAGE_ROLES)
    content = serializers.CharField(allow_blank=True, trim_whitespace=False)


class RequirementsInput(StrictSerializer):
    model = serializers.CharField(max_length=200)
    est_tokens = serializers.IntegerField(min_value=0, max_value=10**12, default=0)
    # `class` is a Python keyword; the field is declared under its JSON name below.
    memory_mb = serializers.IntegerField(min_value=0, required=False)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        fields["class"] = serializers.ChoiceField(choices=("cpu", "gpu"), required=False)
        return fields


class JobInput(serializers.Serializer):
    """The model-facing input. `messages` is checked; other keys (max_tokens, temperature, ...) pass
    through to the driver, which forwards only the options it knows."""

    messages = MessageInput(many=True, required=False)
    max_tokens = serializers.IntegerField(min_value=1, required=False)

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Expected an object.")
        checked = super().to_internal_value(data)
        return {**data, **checked}


class JobSubmitInput(StrictSerializer):
    type = serializers.ChoiceField(choices=Job.Type.choices)
    team = serializers.SlugField(max_length=64)
    priority = serializers.IntegerField(min_value=Job.PRIORITY_MIN, max_value=Job.PRIORITY_MAX, default=0)
    requirements = RequirementsInput()
    input = JobInput()
    meta = serializers.DictField(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["type"] in (Job.Type.CHAT, Job.Type.TRANSLATE, Job.Type.FLOW) and not attrs["input"].get("messages"):
            raise serializers.ValidationError({"input": {"messages": ["A non-empty list of messages is required."]}})
        return attrs


class JobListFilter(serializers.Serializer):
    """Query parameters of the job list; a filter may repeat (`?status=queued&status=running`)."""

    status = serializers.MultipleChoiceField(choices=Job.Status.choices, required=False)
    type = serializers.MultipleChoiceField(choices=Job.Type.choices, required=False)
    team = serializers.SlugField(required=False)


class JobOutput(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    user = serializers.SlugRelatedField(slug_field="username", read_only=True)
    executor = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = Job
        fields = [
            "id", "type", "team", "user", "priority", "status", "requirements", "executor", "submitted_at",
            "started_at", "finished_at", "tokens_used", "attempts", "input", "result", "error", "meta",
        ]
        read_only_fields = fields


class JobEventOutput(serializers.ModelSerializer):
    executor = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = JobEvent
        fields = ["id", "event", "at", "executor", "meta"]
        read_only_fields = fields


class JobBulkSubmitInput(StrictSerializer):
    """Up to MAX_BULK jobs, each as `POST /api/jobs/` takes it."""

    jobs = JobSubmitInput(many=True, min_length=1, max_length=MAX_BULK)


class JobBulkOutput(serializers.Serializer):
    jobs = JobOutput(many=True, read_only=True)
