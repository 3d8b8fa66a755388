from typing import Any

from django.contrib.auth import get_user_model
from django.utils.module_loading import import_string
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduler.api.serializers import StrictSerializer
from scheduler.models import Job, QueuePolicy
from scheduler.policy import BaseQueuePolicy
from scheduler.selectors import queue_policy
from scheduler.services.policy import EDITABLE, queue_policy_update
from telemachus import rbac
from telemachus.models import Membership, Team


def _import_policy(path: str) -> None:
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise serializers.ValidationError(f"Cannot import {path!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseQueuePolicy)):
        raise serializers.ValidationError(f"{path!r} is not a queue policy class (a BaseQueuePolicy subclass).")


class PolicyInput(StrictSerializer):
    """Every field is optional: fields left out keep their value."""

    team_weights = serializers.DictField(child=serializers.FloatField(min_value=0), required=False)
    default_weight = serializers.FloatField(min_value=0, required=False)
    cost = serializers.ChoiceField(choices=QueuePolicy.Cost.choices, required=False)
    half_life_seconds = serializers.FloatField(min_value=1, max_value=30 * 86400, required=False)
    entry_penalty = serializers.FloatField(min_value=0, required=False)
    aging_after_seconds = serializers.FloatField(min_value=0, required=False)
    aging_step_seconds = serializers.FloatField(min_value=1, required=False)
    aging_max_boost = serializers.IntegerField(min_value=0, max_value=Job.PRIORITY_MAX - Job.PRIORITY_MIN, required=False)
    max_queue_depth = serializers.DictField(child=serializers.IntegerField(min_value=0), required=False)
    priority_map = serializers.DictField(
        child=serializers.IntegerField(min_value=Job.PRIORITY_MIN, max_value=Job.PRIORITY_MAX), required=False
    )
    priority_over_limit = serializers.ChoiceField(choices=QueuePolicy.OverLimit.choices, required=False)
    placement = serializers.ChoiceField(choices=QueuePolicy.Placement.choices, required=False)
    recovery = serializers.ChoiceField(choices=QueuePolicy.Recovery.choices, required=False)
    max_attempts = serializers.IntegerField(min_value=1, max_value=100, required=False)
    policy_class = serializers.CharField(max_length=300, allow_blank=True, required=False)
    share_window_seconds = serializers.FloatField(min_value=1, required=False)
    flow_rounds = serializers.ChoiceField(choices=QueuePolicy.FlowRounds.choices, required=False)

    def validate_team_weights(self, weights: dict[str, float]) -> dict[str, float]:
        _known_teams(weights)
        return weights

    def validate_max_queue_depth(self, depths: dict[str, int]) -> dict[str, int]:
        _known_teams({k for k in depths if k != "default"})
        return depths

    def validate_priority_map(self, mapping: dict[str, int]) -> dict[str, int]:
        roles = set(Membership.Role.values)
        teams = {k.removeprefix("team:") for k in mapping if k.startswith("team:")}
        users = {k.removeprefix("user:") for k in mapping if k.startswith("user:")}
        bad = [k for k in mapping if k not in roles and not k.startswith(("team:", "user:"))]
        if bad:
            raise serializers.ValidationError(
                f"Unknown keys {', '.join(sorted(bad))}: use a role ({', '.join(sorted(roles))}), team:<slug> or user:<name>."
            )
        _known_teams(teams)
        missing = users - set(get_user_model().objects.filter(username__in=users).values_list("username", flat=True))
        if missing:
            raise serializers.ValidationError(f"No user(s) {', '.join(sorted(missing))}.")
        return mapping

    def validate_policy_class(self, path: str) -> str:
        if path:
            _import_policy(path)
        return path


def _known_teams(slugs: Any) -> None:
    missing = set(slugs) - set(Team.objects.filter(slug__in=list(slugs)).values_list("slug", flat=True))
    if missing:
        raise serializers.ValidationError(f"No team(s) {', '.join(sorted(missing))}.")


class PolicyOutput(serializers.ModelSerializer):
    class Meta:
        model = QueuePolicy
        fields = [*EDITABLE, "updated_at"]
        read_only_fields = fields


class PolicyApi(APIView):
    """The queue policy: anyone signed in reads it; operators change it (audited, applies to the
    next claim)."""

    @extend_schema(responses=PolicyOutput)
    def get(self, request: Request) -> Response:
        return Response(PolicyOutput(queue_policy()).data)

    @extend_schema(request=PolicyInput, responses=PolicyOutput)
    def put(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = PolicyInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(PolicyOutput(queue_policy_update(changes=data.validated_data, by=request.user)).data)
