from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from executors.credentials import (
    endpoint_problem,
    meta_problems,
    transport_credential_problems,
    transport_has_credentials,
    transport_shown,
)
from executors.models import MAX_ROUTE_MODELS, Executor, ModelRoute, route_models_problem
from executors.prices import price_problems, prices_stored
from executors.registry import known_kinds
from executors.routes import route_create, route_delete, route_update
from executors.services import executor_create, executor_delete, executor_sync, executor_update
from executors.simknobs import knob_problems
from executors.slurmtransport import transport_problems
from telemachus.errors import NotFound
from telemachus.http.bounds import MEMORY_MB_MAX
from telemachus.http.serializers import StrictSerializer
from telemachus.models import Team
from telemachus.teams import rbac

HTTP_KINDS = ("local-model", "remote-model")


class CapabilitiesInput(serializers.Serializer):
    models = serializers.ListField(child=serializers.CharField(max_length=200), allow_empty=True)
    memory_mb = serializers.IntegerField(min_value=0, max_value=MEMORY_MB_MAX, required=False)
    # The executor also answers embeddings requests (POST {endpoint}/embeddings) for its models.
    embeddings = serializers.BooleanField(required=False)
    # The most tokens a request to its models may hold, prompt and completion (issue #39): a routed
    # job whose prompt does not fit goes to the route's next model.
    context_window = serializers.IntegerField(min_value=1, max_value=100_000_000, required=False)

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
        """Credentials go in api_key, api_key_env or headers (executors/credentials.py); a secret
        anywhere else is refused with where it goes. A shown mask keeps the secret stored at its
        place, so a transport read and sent back keeps its secrets."""
        stored = getattr(self.instance, "transport", None)
        if problems := transport_credential_problems(transport, stored=stored):
            raise serializers.ValidationError({path: [problem] for path, problem in problems.items()})
        return transport

    def validate_meta(self, meta: dict[str, Any]) -> dict[str, Any]:
        if problems := meta_problems(meta):
            raise serializers.ValidationError({path: [problem] for path, problem in problems.items()})
        return meta

    def validate_endpoint(self, endpoint: str | None) -> str | None:
        if endpoint and not endpoint.startswith(("http://", "https://")):
            raise serializers.ValidationError("Endpoint must be an http(s) URL.")
        if problem := endpoint_problem(endpoint):
            raise serializers.ValidationError(problem)
        return endpoint

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        kind = attrs.get("kind", getattr(self.instance, "kind", None))
        endpoint = attrs["endpoint"] if "endpoint" in attrs else getattr(self.instance, "endpoint", None)
        if kind in HTTP_KINDS and not endpoint:
            raise serializers.ValidationError({"endpoint": [f"A {kind} executor needs an endpoint."]})
        transport = attrs["transport"] if "transport" in attrs else getattr(self.instance, "transport", {})
        if kind == "remote-model" and not transport_has_credentials(transport or {}):
            raise serializers.ValidationError(
                {
                    "transport": [
                        "A remote-model executor needs its key: transport.api_key (the key, or "
                        '{"env": "VARIABLE"} naming the environment variable that holds it), api_key_env '
                        "or headers."
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
    """An executor as the API shows it: its secrets masked (executors/credentials.py)."""

    team = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)  # type: ignore[var-annotated]
    transport = serializers.SerializerMethodField()

    @extend_schema_field(OpenApiTypes.OBJECT)
    def get_transport(self, executor: Executor) -> dict[str, Any]:
        return transport_shown(executor.transport)

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


class RouteInput(StrictSerializer):
    name = serializers.CharField(max_length=200, help_text="The name apps call, as a model name.")
    models = serializers.ListField(
        child=serializers.CharField(max_length=200),
        help_text=f"The models it stands for, tried in this order (1 to {MAX_ROUTE_MODELS}).",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        name = attrs.get("name", getattr(self.instance, "name", ""))
        models = attrs.get("models", getattr(self.instance, "models", []))
        if problem := route_models_problem(name, models):
            raise serializers.ValidationError({"models": [problem]})
        if "name" in attrs:
            taken = ModelRoute.objects.filter(name=name).exclude(pk=getattr(self.instance, "pk", None))  # type: ignore[misc]
            if taken.exists():
                raise serializers.ValidationError({"name": [f"A route named {name!r} already exists."]})
        return attrs


class RouteOutput(serializers.ModelSerializer):
    class Meta:
        model = ModelRoute
        fields = ["id", "name", "models", "created_at", "updated_at"]
        read_only_fields = fields


def managed_route(request: Request, route_id: int) -> ModelRoute:
    rbac.require_operator(request.user)
    route = ModelRoute.objects.filter(pk=route_id).first()
    if route is None:
        raise NotFound(f"Route {route_id} not found.")
    return route


class RouteListCreateApi(ListAPIView):
    """Model routes: every signed-in user may read them (apps call their names); operators edit."""

    serializer_class = RouteOutput

    def get_queryset(self) -> QuerySet[ModelRoute]:
        return ModelRoute.objects.all()

    @extend_schema(request=RouteInput, responses={201: RouteOutput})
    def post(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = RouteInput(data=request.data)
        data.is_valid(raise_exception=True)
        route = route_create(by=request.user, **data.validated_data)
        return Response(RouteOutput(route).data, status=status.HTTP_201_CREATED)


class RouteDetailApi(APIView):
    @extend_schema(responses=RouteOutput)
    def get(self, request: Request, route_id: int) -> Response:
        route = ModelRoute.objects.filter(pk=route_id).first()
        if route is None:
            raise NotFound(f"Route {route_id} not found.")
        return Response(RouteOutput(route).data)

    @extend_schema(request=RouteInput, responses=RouteOutput)
    def patch(self, request: Request, route_id: int) -> Response:
        route = managed_route(request, route_id)
        data = RouteInput(route, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        return Response(RouteOutput(route_update(route=route, by=request.user, **data.validated_data)).data)

    put = patch

    @extend_schema(responses={204: None})
    def delete(self, request: Request, route_id: int) -> Response:
        route_delete(route=managed_route(request, route_id), by=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
