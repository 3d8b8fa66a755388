import re
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from executors.models import Executor
from executors.prices import price_problems, prices_stored
from executors.registry import known_kinds
from executors.services import executor_create, executor_delete, executor_sync, executor_update
from executors.simknobs import knob_problems
from executors.slurmtransport import transport_problems
from telemachus.errors import NotFound
from telemachus.http.bounds import MEMORY_MB_MAX
from telemachus.http.serializers import StrictSerializer
from telemachus.models import Team
from telemachus.teams import rbac

HTTP_KINDS = ("local-model", "remote-model")
SECRET_KEY_NAMES = re.compile(r"key|token|secret|password|passwd|auth|bearer|credential", re.IGNORECASE)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class CapabilitiesInput(serializers.Serializer):
    models = serializers.ListField(child=serializers.CharField(max_length=200), allow_empty=True)
    memory_mb = serializers.IntegerField(min_value=0, max_value=MEMORY_MB_MAX, required=False)
    # The executor also answers embeddings requests (POST {endpoint}/embeddings) for its models.
    embeddings = serializers.BooleanField(required=False)

    def get_fields(self) -> dict[str, serializers.Field]:
        fields = super().get_fields()
        fields["class"] = serializers.ChoiceField(choices=("cpu", "gpu"), required=False)
        return fields

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Expected an object.")
        return {**data, **super().to_internal_value(data)}


class ExecutorInput(StrictSerializer):
    name = serializers.SlugField(max_length=64)
    kind = serializers.CharField(max_length=32)
    team = serializers.SlugRelatedField(slug_field="slug", queryset=Team.objects.all(), allow_null=True, required=False)
    endpoint = serializers.URLField(max_length=500, allow_null=True, required=False)
    capabilities = CapabilitiesInput()
    max_concurrency = serializers.IntegerField(min_value=0, max_value=100_000, default=4)
    enabled = serializers.BooleanField(default=True)
    weight = serializers.IntegerField(min_value=0, max_value=1_000_000, default=1)
    transport = serializers.DictField(required=False)
    meta = serializers.DictField(required=False)
    prices = serializers.DictField(
        required=False,
        help_text='Per model: {"input": "<price per 1M input tokens>", "output": "<price per 1M output tokens>"}, '
        "decimal strings in TELEMACHUS_CURRENCY. Replaces the executor's prices as a whole.",
    )

    def validate_prices(self, prices: dict[str, Any]) -> dict[str, dict[str, str]]:
        problems = price_problems(prices)
        if problems:
            raise serializers.ValidationError({model: [problem] for model, problem in problems.items()})
        return prices_stored(prices)

    def validate_kind(self, kind: str) -> str:
        if kind not in known_kinds():
            raise serializers.ValidationError(f"Unknown kind; known kinds: {', '.join(known_kinds())}.")
        return kind

    def validate_transport(self, transport: dict[str, Any]) -> dict[str, Any]:
        """Secrets never go in the database: a key must live in an environment variable that
        `api_key_env` names."""
        secret_like = [k for k in transport if SECRET_KEY_NAMES.search(k) and k != "api_key_env"]
        if secret_like:
            raise serializers.ValidationError(
                f"Do not store secrets here ({', '.join(sorted(secret_like))}): put the key in an environment "
                "variable of the workers and name it in transport.api_key_env."
            )
        env = transport.get("api_key_env")
        if env is not None and not (isinstance(env, str) and ENV_NAME.fullmatch(env)):
            raise serializers.ValidationError("api_key_env must be an environment variable name, like OPENAI_API_KEY.")
        return transport

    def validate_endpoint(self, endpoint: str | None) -> str | None:
        if endpoint and not endpoint.startswith(("http://", "https://")):
            raise serializers.ValidationError("Endpoint must be an http(s) URL.")
        return endpoint

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        kind = attrs.get("kind", getattr(self.instance, "kind", None))
        endpoint = attrs["endpoint"] if "endpoint" in attrs else getattr(self.instance, "endpoint", None)
        if kind in HTTP_KINDS and not endpoint:
            raise serializers.ValidationError({"endpoint": [f"A {kind} executor needs an endpoint."]})
        transport = attrs["transport"] if "transport" in attrs else getattr(self.instance, "transport", {})
        if kind == "remote-model" and not (transport or {}).get("api_key_env"):
            raise serializers.ValidationError(
                {
                    "transport": [
                        "A remote-model executor needs transport.api_key_env (the variable holding its API key)."
                    ]
                }
            )
        if kind == "hpc-partition" and isinstance(transport, dict) and (problems := transport_problems(transport)):
            raise serializers.ValidationError({"transport": {name: [problem] for name, problem in problems.items()}})
        meta = attrs["meta"] if "meta" in attrs else getattr(self.instance, "meta", {})
        if kind == "sim" and isinstance(meta, dict) and (problems := knob_problems(meta)):
            raise serializers.ValidationError({"meta": {name: [problem] for name, problem in problems.items()}})
        name = attrs.get("name")
        if name and Executor.objects.filter(name=name).exclude(pk=getattr(self.instance, "pk", None)).exists():  # type: ignore[misc]
            raise serializers.ValidationError({"name": [f"An executor named {name!r} already exists."]})
        return attrs


class ExecutorOutput(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)  # type: ignore[var-annotated]

    class Meta:
        model = Executor
        fields = [
            "id",
            "name",
            "kind",
            "team",
            "endpoint",
            "capabilities",
            "max_concurrency",
            "enabled",
            "health",
            "last_seen",
            "breaker",
            "consecutive_failures",
            "breaker_until",
            "weight",
            "transport",
            "meta",
            "prices",
        ]
        read_only_fields = fields


def managed_executor(request: Request, executor_id: int) -> Executor:
    rbac.require_operator(request.user)
    executor = Executor.objects.select_related("team").filter(pk=executor_id).first()
    if executor is None:
        raise NotFound(f"Executor {executor_id} not found.")
    return executor


class ExecutorListCreateApi(ListAPIView):
    serializer_class = ExecutorOutput

    def get_queryset(self) -> QuerySet[Executor]:
        rbac.require_operator(self.request.user)
        return Executor.objects.select_related("team")

    @extend_schema(request=ExecutorInput, responses={201: ExecutorOutput})
    def post(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = ExecutorInput(data=request.data)
        data.is_valid(raise_exception=True)
        executor = executor_create(by=request.user, **data.validated_data)
        return Response(ExecutorOutput(executor).data, status=status.HTTP_201_CREATED)


class ExecutorDetailApi(APIView):
    @extend_schema(responses=ExecutorOutput)
    def get(self, request: Request, executor_id: int) -> Response:
        return Response(ExecutorOutput(managed_executor(request, executor_id)).data)

    @extend_schema(request=ExecutorInput, responses=ExecutorOutput)
    def patch(self, request: Request, executor_id: int) -> Response:
        executor = managed_executor(request, executor_id)
        data = ExecutorInput(executor, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        return Response(ExecutorOutput(executor_update(executor=executor, by=request.user, **data.validated_data)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, executor_id: int) -> Response:
        executor_delete(executor=managed_executor(request, executor_id), by=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class ExecutorSyncApi(APIView):
    """Read the models the executor serves into capabilities.models."""

    @extend_schema(request=None, responses=ExecutorOutput)
    def post(self, request: Request, executor_id: int) -> Response:
        return Response(
            ExecutorOutput(executor_sync(executor=managed_executor(request, executor_id), by=request.user)).data
        )
