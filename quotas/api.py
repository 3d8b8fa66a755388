from decimal import Decimal
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from quotas.models import MONEY_DIGITS, MONEY_PLACES, QuotaPolicy, limit_text
from quotas.rules import quota_rule_errors
from quotas.selectors import usage_report
from quotas.services import quota_policy_create, quota_policy_delete, quota_policy_update
from telemachus.errors import NotFound
from telemachus.http.pagination import query_params_check
from telemachus.http.serializers import StrictSerializer
from telemachus.teams import rbac

LIMIT_SCHEMA = {
    "oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "format": "decimal"}],
    "description": "A whole number; for ai.cost an amount in TELEMACHUS_CURRENCY, as a decimal string.",
}
MAX_COUNT = 2**62


@extend_schema_field(LIMIT_SCHEMA)
class LimitField(serializers.DecimalField):
    """A count, or for `ai.cost` an amount (a decimal string, or a number)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(max_digits=MONEY_DIGITS, decimal_places=MONEY_PLACES, min_value=Decimal(0), **kwargs)


class QuotaPolicyInput(StrictSerializer):
    scope = serializers.ChoiceField(choices=QuotaPolicy.Scope.choices)
    subject = serializers.CharField(max_length=150, allow_null=True, required=False)
    dimension = serializers.ChoiceField(choices=QuotaPolicy.Dimension.choices)
    limit = LimitField()
    window = serializers.ChoiceField(choices=QuotaPolicy.Window.choices, allow_null=True, required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """Checks the rule as a whole (merged over the instance for a partial update) and returns the
        fields in storage form: "" for the global subject and for a concurrency rule's window."""
        stored = {**attrs}
        for name in ("subject", "window"):
            if name in stored:
                stored[name] = stored[name] or ""
        rule = {
            name: stored.get(name, getattr(self.instance, name, ""))
            for name in ("scope", "subject", "dimension", "window")
        }
        errors = quota_rule_errors(**rule, exclude_pk=getattr(self.instance, "pk", None))
        limit = stored.get("limit", getattr(self.instance, "limit", None))
        if limit is not None and rule["dimension"] != QuotaPolicy.Dimension.COST:
            if limit != limit.to_integral_value() or limit > MAX_COUNT:
                errors["limit"] = [f"A whole number from 0 to {MAX_COUNT} for {rule['dimension']}."]
        if errors:
            raise serializers.ValidationError(errors)
        return stored


class QuotaPolicyOutput(serializers.ModelSerializer[QuotaPolicy]):
    subject = serializers.SerializerMethodField()
    window = serializers.SerializerMethodField()
    limit = serializers.SerializerMethodField()

    class Meta:
        model = QuotaPolicy
        fields = ["id", "scope", "subject", "dimension", "limit", "window"]
        read_only_fields = fields

    def get_subject(self, policy: QuotaPolicy) -> str | None:
        return policy.subject or None

    def get_window(self, policy: QuotaPolicy) -> str | None:
        return policy.window or None

    @extend_schema_field(LIMIT_SCHEMA)
    def get_limit(self, policy: QuotaPolicy) -> int | str:
        text = limit_text(policy.dimension, policy.limit)
        return text if policy.dimension == QuotaPolicy.Dimension.COST else int(text)


def managed_policy(request: Request, policy_id: int) -> QuotaPolicy:
    rbac.require_operator(request.user)
    policy = QuotaPolicy.objects.filter(pk=policy_id).first()
    if policy is None:
        raise NotFound(f"Quota policy {policy_id} not found.")
    return policy


class QuotaPolicyListCreateApi(ListAPIView[QuotaPolicy]):
    serializer_class = QuotaPolicyOutput

    def get_queryset(self) -> QuerySet[QuotaPolicy]:
        rbac.require_operator(self.request.user)
        return QuotaPolicy.objects.all()

    @extend_schema(request=QuotaPolicyInput, responses={201: QuotaPolicyOutput})
    def post(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = QuotaPolicyInput(data=request.data)
        data.is_valid(raise_exception=True)
        policy = quota_policy_create(by=request.user, **data.validated_data)
        return Response(QuotaPolicyOutput(policy).data, status=status.HTTP_201_CREATED)


class QuotaPolicyDetailApi(APIView):
    @extend_schema(responses=QuotaPolicyOutput)
    def get(self, request: Request, policy_id: int) -> Response:
        return Response(QuotaPolicyOutput(managed_policy(request, policy_id)).data)

    @extend_schema(request=QuotaPolicyInput, responses=QuotaPolicyOutput)
    def put(self, request: Request, policy_id: int) -> Response:
        return self.update(request, policy_id, partial=False)

    @extend_schema(request=QuotaPolicyInput, responses=QuotaPolicyOutput)
    def patch(self, request: Request, policy_id: int) -> Response:
        return self.update(request, policy_id, partial=True)

    def update(self, request: Request, policy_id: int, *, partial: bool) -> Response:
        policy = managed_policy(request, policy_id)
        data = QuotaPolicyInput(policy, data=request.data, partial=partial)
        data.is_valid(raise_exception=True)
        return Response(
            QuotaPolicyOutput(quota_policy_update(policy=policy, by=request.user, **data.validated_data)).data
        )

    @extend_schema(responses={204: None})
    def delete(self, request: Request, policy_id: int) -> Response:
        quota_policy_delete(policy=managed_policy(request, policy_id), by=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class UsageFilter(serializers.Serializer[Any]):
    team = serializers.SlugField(required=False)
    user = serializers.CharField(required=False)


class UsageApi(APIView):
    """GET /api/usage/?team=&user=: usage, limit, remaining and reset time per budget."""

    @extend_schema(parameters=[UsageFilter], responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        query_params_check(request, UsageFilter().fields)
        filters = UsageFilter(data=request.query_params)
        filters.is_valid(raise_exception=True)
        report = usage_report(
            user=request.user, team=filters.validated_data.get("team"), username=filters.validated_data.get("user")
        )
        return Response({"results": report})
