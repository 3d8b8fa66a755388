"""GET / PUT /api/features/: feature switches (job kinds and the OpenAI-compatible endpoint)."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from telemachus.control.features import FEATURES, feature_set, feature_states
from telemachus.http.serializers import StrictSerializer
from telemachus.models import Team
from telemachus.teams import rbac


class FeatureSwitchInput(StrictSerializer):
    feature = serializers.ChoiceField(choices=FEATURES)
    team = serializers.SlugRelatedField(
        slug_field="slug",
        queryset=Team.objects.all(),
        allow_null=True,
        required=False,
        help_text="A team's own switch; null or absent: the global one.",
    )
    enabled = serializers.BooleanField(allow_null=True, help_text="null on a team: follow the global switch.")

    def validate(self, attrs: dict) -> dict:
        if attrs.get("team") is None and attrs["enabled"] is None:
            raise serializers.ValidationError({"enabled": ["The global switch is on or off (true or false)."]})
        return attrs


class FeatureApi(APIView):
    """Everyone signed in reads the switches of the teams they see; operators switch."""

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(feature_states(teams=rbac.visible_teams(request.user)))

    @extend_schema(request=FeatureSwitchInput, responses=OpenApiTypes.OBJECT)
    def put(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = FeatureSwitchInput(data=request.data)
        data.is_valid(raise_exception=True)
        feature_set(**{"team": None, **data.validated_data}, by=request.user)
        return Response(feature_states(teams=rbac.visible_teams(request.user)))
