from typing import Any

from django.contrib.auth import get_user_model
from django.utils.module_loading import import_string
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from scheduler.core.bounds import MAPS, SCALARS, field_problem
from scheduler.core.configuration import queue_policy
from scheduler.core.policy import BaseQueuePolicy
from scheduler.core.selectors import policy_seen_by
from scheduler.models import QueuePolicy
from scheduler.services.policy import EDITABLE, queue_policy_update
from telemachus.http.serializers import StrictSerializer
from telemachus.models import Membership, Team
from telemachus.teams import rbac


def _import_policy(path: str) -> None:
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise serializers.ValidationError(f"Cannot import {path!r}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, BaseQueuePolicy)):
        raise serializers.ValidationError(f"{path!r} is not a queue policy class (a BaseQueuePolicy subclass).")


class NumberField(serializers.FloatField):
    """A float that is not a boolean (DRF's FloatField takes `true` as 1.0)."""

    def to_internal_value(self, data: Any) -> float:
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


def bounded(name: str, **kwargs: Any) -> serializers.Field[Any, Any, Any, Any]:
    """A number field with the policy's bounds for `name` (scheduler/core/bounds.py)."""
    low, high, kind = SCALARS.get(name) or MAPS[name]
    if kind is int:
        return serializers.IntegerField(min_value=int(low), max_value=int(high), **kwargs)
    return NumberField(min_value=low, max_value=high, **kwargs)


class PolicyInput(StrictSerializer):
    """Every field is optional: fields left out keep their value. Numbers are bounded (a setting
    outside its bounds is a 400 naming them, never a claim that cannot run)."""

    team_weights = serializers.DictField(child=bounded("team_weights"), required=False)
    default_weight = bounded("default_weight", required=False)
    cost = serializers.ChoiceField(choices=QueuePolicy.Cost.choices, required=False)
    half_life_seconds = bounded("half_life_seconds", required=False)
    entry_penalty = bounded("entry_penalty", required=False)
    aging_after_seconds = bounded("aging_after_seconds", required=False)
    aging_step_seconds = bounded("aging_step_seconds", required=False)
    aging_max_boost = bounded("aging_max_boost", required=False)
    max_queue_depth = serializers.DictField(child=bounded("max_queue_depth"), required=False)
    priority_map = serializers.DictField(child=bounded("priority_map"), required=False)
    priority_over_limit = serializers.ChoiceField(choices=QueuePolicy.OverLimit.choices, required=False)
    placement = serializers.ChoiceField(choices=QueuePolicy.Placement.choices, required=False)
    recovery = serializers.ChoiceField(choices=QueuePolicy.Recovery.choices, required=False)
    max_attempts = bounded("max_attempts", required=False)
    policy_class = serializers.CharField(max_length=300, allow_blank=True, required=False)
    share_window_seconds = bounded("share_window_seconds", required=False)
    flow_rounds = serializers.ChoiceField(choices=QueuePolicy.FlowRounds.choices, required=False)
    affinity = serializers.ChoiceField(choices=QueuePolicy.Affinity.choices, required=False)
    affinity_wait_ms = bounded("affinity_wait_ms", required=False)
    batch_share = bounded("batch_share", required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """The shared bounds (scheduler/core/bounds.py) have the last word, so the API, the admin
        and the claim agree on what a valid policy is."""
        problems = {
            name: [f"This value {problem}."]
            for name, value in attrs.items()
            if (problem := field_problem(name, value)) is not None
        }
        if problems:
            raise serializers.ValidationError(problems)
        return attrs

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
                f"Unknown keys {', '.join(sorted(bad))}: use a role ({', '.join(sorted(roles))}), "
                "team:<slug> or user:<name>."
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


class PolicyOutput(serializers.ModelSerializer[QueuePolicy]):
    class Meta:
        model = QueuePolicy
        fields = [*EDITABLE, "updated_at"]
        read_only_fields = fields


class PolicyApi(APIView):
    """The queue policy: anyone signed in reads it; operators change it (audited, applies to the
    next claim)."""

    @extend_schema(responses=PolicyOutput)
    def get(self, request: Request) -> Response:
        return Response(policy_seen_by(request.user, PolicyOutput(queue_policy()).data))

    @extend_schema(request=PolicyInput, responses=PolicyOutput)
    def put(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = PolicyInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(PolicyOutput(queue_policy_update(changes=data.validated_data, by=request.user)).data)

    @extend_schema(request=PolicyInput, responses=PolicyOutput)
    def patch(self, request: Request) -> Response:
        """The same as PUT: every field is optional either way, and fields left out keep their value."""
        return self.put(request)
