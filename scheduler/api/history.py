"""GET /api/queue/history/: what the dashboard's charts draw, for anyone signed in, limited to
the teams and executors they may see (scheduler/live/history.py)."""

from typing import Any

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduler.live.history import history_range_minutes, history_series
from telemachus.errors import ValidationFailed
from telemachus.http.pagination import query_params_check

DEFAULT_MINUTES = 60


class HistoryQuery(serializers.Serializer[Any]):
    minutes = serializers.IntegerField(
        min_value=1, default=DEFAULT_MINUTES, help_text="How far back, up to the history kept (default 60)."
    )

    def validate_minutes(self, value: int) -> int:
        if value > history_range_minutes():
            raise serializers.ValidationError(f"At most {history_range_minutes()} (the history kept).")
        return value


class QueueHistoryApi(APIView):
    """The last `minutes` of the queue's history: per team (queued, running, slots in use, jobs
    started and ended, tokens, queue wait p50/p95), per executor (slots in use, limit) and for the
    whole queue, as aligned columns: `times` (epoch seconds) and one list per measure."""

    @extend_schema(parameters=[HistoryQuery], responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        query_params_check(request, ["minutes"])
        query = HistoryQuery(data=request.query_params)
        if not query.is_valid():
            raise ValidationFailed(query.errors)
        return Response(history_series(user=request.user, minutes=query.validated_data["minutes"]))
