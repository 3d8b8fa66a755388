"""GET /api/spend/: tokens and money spent per UTC day, from the spend ledger (quotas.Spend), which
every attempt that used tokens adds to as it is billed (quotas/budget.py).

Operators see everything; members of a team see their teams' spend (all of it: a team's spend is
its members' business); an app's API key sees its own."""

from datetime import date
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db.models import QuerySet, Sum
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from quotas.models import ZERO, Spend, money_text
from telemachus.errors import NotFound, ValidationFailed
from telemachus.http.pagination import query_params_check
from telemachus.keys.authentication import request_api_key
from telemachus.keys.models import ApiKey
from telemachus.teams import rbac

TOTALS = ("requests", "tokens", "prompt_tokens", "completion_tokens", "cost")


class SpendFilter(serializers.Serializer[Any]):
    team = serializers.SlugField(required=False)
    key = serializers.IntegerField(required=False, min_value=1)
    user = serializers.CharField(required=False, max_length=150)
    model = serializers.CharField(required=False, max_length=200)

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        # `from` is a Python keyword: declared by its query-parameter name here.
        fields["from"] = serializers.DateField(required=False, help_text="First day (UTC), inclusive.")
        fields["to"] = serializers.DateField(required=False, help_text="Last day (UTC), inclusive.")
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("from") and attrs.get("to") and attrs["from"] > attrs["to"]:
            raise serializers.ValidationError({"to": ["Must not be before `from`."]})
        return attrs


def spend_visible(*, user: rbac.Principal, key: ApiKey | None) -> QuerySet[Spend]:
    """The spend rows a caller may see: an API key its own, operators all, others their teams'."""
    if key is not None:
        return Spend.objects.filter(user__api_key=key)
    if rbac.is_operator(user):
        return Spend.objects.all()
    return Spend.objects.filter(team__in=rbac.visible_teams(user))


def spend_report(
    *,
    user: rbac.Principal,
    caller_key: ApiKey | None = None,
    team: str | None = None,
    key: int | None = None,
    username: str | None = None,
    model: str | None = None,
    since: date | None = None,
    until: date | None = None,
) -> dict[str, Any]:
    """Requests, tokens and cost per day (and in total) of what the caller may see, narrowed by
    the filters. A team or key the caller cannot see is a 404, as elsewhere."""
    rows = spend_visible(user=user, key=caller_key)
    if team is not None:
        if not rbac.visible_teams(user).filter(slug=team).exists():
            raise NotFound(f"Team {team!r} not found.")
        rows = rows.filter(team__slug=team)
    if key is not None:
        if not ApiKey.objects.filter(pk=key, team__in=rbac.visible_teams(user)).exists():
            raise NotFound(f"API key {key} not found.")
        rows = rows.filter(key_id=key)
    if username is not None:
        rows = rows.filter(user__username=username)
    if model is not None:
        rows = rows.filter(model=model)
    if since is not None:
        rows = rows.filter(day__gte=since)
    if until is not None:
        rows = rows.filter(day__lte=until)
    grouped = rows.order_by().values("day").annotate(**{name: Sum(name) for name in TOTALS}).order_by("day")
    days: list[dict[str, Any]] = [dict(day) for day in grouped]
    total: dict[str, Any] = {
        name: sum((day[name] or 0 for day in days), ZERO if name == "cost" else 0) for name in TOTALS
    }
    return {
        "currency": settings.TELEMACHUS_CURRENCY,
        "results": [_shown(day) for day in days],
        "total": _shown(total),
    }


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    shown = {name: row[name] or 0 for name in TOTALS}
    shown["cost"] = money_text(Decimal(row["cost"] or 0))
    if "day" in row:
        shown = {"day": row["day"], **shown}
    return shown


class SpendApi(APIView):
    """GET /api/spend/?team=&key=&user=&model=&from=&to=: tokens and cost per day."""

    serves_api_keys = True

    @extend_schema(
        parameters=[
            OpenApiParameter("team", str),
            OpenApiParameter("key", int),
            OpenApiParameter("user", str),
            OpenApiParameter("model", str),
            OpenApiParameter("from", OpenApiTypes.DATE),
            OpenApiParameter("to", OpenApiTypes.DATE),
        ],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request: Request) -> Response:
        filters = SpendFilter(data=request.query_params)
        query_params_check(request, filters.fields)
        if not filters.is_valid():
            raise ValidationFailed(filters.errors)
        data = filters.validated_data
        return Response(
            spend_report(
                user=request.user,
                caller_key=request_api_key(request),
                team=data.get("team"),
                key=data.get("key"),
                username=data.get("user"),
                model=data.get("model"),
                since=data.get("from"),
                until=data.get("to"),
            )
        )
