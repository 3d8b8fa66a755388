from typing import Any

from rest_framework import serializers
from rest_framework.exceptions import ErrorDetail

from executors.contract import CHAT_API, EMBEDDINGS_API
from executors.tokens import embedding_inputs
from quotas.models import money_text
from scheduler.models import Job, JobEvent
from scheduler.services.rounds import DEFAULT_MAX_ROUNDS, MAX_ROUNDS
from scheduler.services.submit import BUDGET_FAIL, BUDGET_WAIT, MAX_BULK, MAX_QUEUE_SECONDS
from telemachus.http.bounds import EST_TOKENS_MAX, MAX_TOKENS, MEMORY_MB_MAX
from telemachus.http.serializers import StrictSerializer

MESSAGE_ROLES = ("system", "user", "assistant", "tool", "developer")


class MessageInput(serializers.Serializer[Any]):
    """An OpenAI chat message: an assistant message that calls tools may have no content; a tool
    message answers one call by its id."""

    role = serializers.ChoiceField(choices=MESSAGE_ROLES)
    content = serializers.CharField(allow_blank=True, allow_null=True, trim_whitespace=False, required=False)
    name = serializers.CharField(max_length=200, required=False)
    tool_calls = serializers.ListField(child=serializers.DictField(), required=False)
    tool_call_id = serializers.CharField(max_length=200, required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("content") is None and not attrs.get("tool_calls"):
            raise serializers.ValidationError({"content": ["This field is required."]})
        return attrs


class RequirementsInput(StrictSerializer):
    model = serializers.CharField(max_length=200)
    # Without it the submit estimates the job (scheduler/core/estimates.py): budgets always reserve
    # a real estimate.
    est_tokens = serializers.IntegerField(min_value=0, max_value=EST_TOKENS_MAX, required=False)
    # The model API a chat job calls: completions (the default) or embeddings of `input.input`.
    api = serializers.ChoiceField(choices=(CHAT_API, EMBEDDINGS_API), required=False)
    # `class` is a Python keyword; the field is declared under its JSON name below.
    memory_mb = serializers.IntegerField(min_value=0, max_value=MEMORY_MB_MAX, required=False)
    # A budget spent while the job waits: wait for its window to reset (the default), or fail at
    # once with the quota error (docs/policy.md, "Budgets").
    on_budget_exhausted = serializers.ChoiceField(choices=(BUDGET_WAIT, BUDGET_FAIL), required=False)
    # How long the job may wait for a slot (issue #39): past it, a job on a model route moves to
    # its next model that can start it now; otherwise it ends failed, 429 queue_deadline_exceeded.
    max_queue_seconds = serializers.FloatField(min_value=0, max_value=MAX_QUEUE_SECONDS, required=False)

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        fields["class"] = serializers.ChoiceField(choices=("cpu", "gpu"), required=False)
        return fields


class JobInput(serializers.Serializer[Any]):
    """The model-facing input. `messages` is checked; other keys (max_tokens, temperature, ...) pass
    through to the driver, which forwards only the options it knows."""

    messages = MessageInput(many=True, required=False)
    # Bounded as the OpenAI-compatible endpoint bounds them; either one sets the job's estimate.
    max_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS, required=False)
    max_completion_tokens = serializers.IntegerField(min_value=1, max_value=MAX_TOKENS, required=False)

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Expected an object.")
        checked = super().to_internal_value(data)
        return {**data, **checked}


class FlowInput(serializers.Serializer[Any]):
    """A flow: the conversation to start from, the registered tools the model may call (their
    existence and the tools:invoke permission are checked at submit), and its bounds."""

    messages = MessageInput(many=True, allow_empty=False)
    tools = serializers.ListField(child=serializers.CharField(max_length=200), required=False, default=list)
    max_rounds = serializers.IntegerField(min_value=1, max_value=MAX_ROUNDS, default=DEFAULT_MAX_ROUNDS)
    # A failing tool call fails the flow, unless this passes its error back to the model instead.
    return_tool_errors = serializers.BooleanField(default=False)


class ToolJobInput(StrictSerializer):
    tool = serializers.CharField(max_length=200)
    arguments = serializers.DictField(default=dict)


class TranslateInput(serializers.Serializer[Any]):
    text = serializers.CharField(trim_whitespace=False)
    target_lang = serializers.CharField(max_length=64)
    source_lang = serializers.CharField(max_length=64, required=False)


# The input each job type must have beyond JobInput's (whose other keys pass through).
TYPE_INPUTS: dict[str, type[serializers.Serializer[Any]]] = {
    Job.Type.FLOW: FlowInput,
    Job.Type.TOOL: ToolJobInput,
    Job.Type.TRANSLATE: TranslateInput,
}
# A governed slot is taken in Python (scheduler/flows/governed.py), never submitted through the API.
SUBMITTABLE_TYPES = [(value, label) for value, label in Job.Type.choices if value != Job.Type.GOVERNED]


REQUIRED = "This field is required."


def _needs_requirements(data: dict[str, Any]) -> bool:
    return "requirements" not in data and data.get("type") != Job.Type.TOOL


class JobSubmitInput(StrictSerializer):
    type = serializers.ChoiceField(choices=SUBMITTABLE_TYPES)
    # Required, except with an app's API key (context `key`), whose team is the job's.
    team = serializers.SlugField(max_length=64)
    priority = serializers.IntegerField(min_value=Job.PRIORITY_MIN, max_value=Job.PRIORITY_MAX, default=0)
    # Required, except for a tool job, which runs on no executor and so needs no model. Checked in
    # `validate`, which runs for each item of a bulk submit too (a field swapped in by looking at
    # `initial_data` was seen by single submits only).
    requirements = RequirementsInput(required=False)
    input = JobInput()
    meta = serializers.DictField(required=False)

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        if self.context.get("key") is not None:
            fields["team"] = serializers.SlugField(max_length=64, required=False)
        return fields

    def to_internal_value(self, data: Any) -> Any:
        try:
            return super().to_internal_value(data)
        except serializers.ValidationError as exc:
            # Report a missing `requirements` with the other fields' errors, as a required field is.
            if isinstance(exc.detail, dict) and isinstance(data, dict) and _needs_requirements(data):
                exc.detail.setdefault("requirements", [ErrorDetail(REQUIRED, code="required")])
            raise

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        kind = attrs["type"]
        if _needs_requirements(attrs):
            raise serializers.ValidationError({"requirements": [REQUIRED]})
        attrs.setdefault("requirements", {})
        if attrs["requirements"].get("api") == EMBEDDINGS_API:
            if kind != Job.Type.CHAT:
                raise serializers.ValidationError({"requirements": {"api": ["Embeddings are chat jobs."]}})
            if not embedding_inputs(attrs["input"].get("input")):
                raise serializers.ValidationError({"input": {"input": ["A string or a list of strings to embed."]}})
        elif kind == Job.Type.CHAT and not attrs["input"].get("messages"):
            raise serializers.ValidationError({"input": {"messages": ["A non-empty list of messages is required."]}})
        if kind in TYPE_INPUTS:
            shape = TYPE_INPUTS[kind](data=attrs["input"])
            if not shape.is_valid():
                raise serializers.ValidationError({"input": shape.errors})
            attrs["input"] = {**attrs["input"], **shape.validated_data}
        return attrs


class JobListFilter(serializers.Serializer[Any]):
    """Query parameters of the job list; a filter may repeat (`?status=queued&status=running`)."""

    status = serializers.MultipleChoiceField(choices=Job.Status.choices, required=False)
    type = serializers.MultipleChoiceField(choices=Job.Type.choices, required=False)
    team = serializers.SlugField(required=False)


class JobOutput(serializers.ModelSerializer[Job]):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)  # type: ignore[var-annotated]
    user = serializers.SlugRelatedField(slug_field="username", read_only=True)  # type: ignore[var-annotated]
    executor = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)  # type: ignore[var-annotated]
    cost = serializers.SerializerMethodField(
        help_text="What its attempts cost (tokens x the executor's prices), a decimal string in TELEMACHUS_CURRENCY."
    )

    def get_cost(self, job: Job) -> str:
        return money_text(job.cost)

    class Meta:
        model = Job
        fields = [
            "id",
            "type",
            "team",
            "user",
            "priority",
            "status",
            "requirements",
            "model",
            "route",
            "executor",
            "submitted_at",
            "started_at",
            "finished_at",
            "tokens_used",
            "cost",
            "key",
            "attempts",
            "rounds",
            "input",
            "result",
            "error",
            "meta",
            "body_removed_at",
        ]
        read_only_fields = fields


class JobEventOutput(serializers.ModelSerializer[JobEvent]):
    executor = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)  # type: ignore[var-annotated]

    class Meta:
        model = JobEvent
        fields = ["id", "event", "at", "executor", "meta"]
        read_only_fields = fields


class JobBulkSubmitInput(StrictSerializer):
    """Up to MAX_BULK jobs, each as `POST /api/jobs/` takes it."""

    jobs = JobSubmitInput(many=True, min_length=1, max_length=MAX_BULK)  # type: ignore[call-arg]


class JobBulkOutput(serializers.Serializer[Any]):
    jobs = JobOutput(many=True, read_only=True)
