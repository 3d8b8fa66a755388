"""/api/keys/: apps' API keys. Members of a team see its keys (never a secret); its managers and
operators create and revoke them. The secret is in the creating response only."""

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from telemachus.errors import NotFound
from telemachus.http.serializers import StrictSerializer
from telemachus.keys.models import ApiKey
from telemachus.keys.services import api_key_create, api_key_revoke
from telemachus.teams import rbac


class ApiKeyInput(StrictSerializer):
    team = serializers.SlugField(max_length=64)
    name = serializers.CharField(max_length=100)
    models = serializers.ListField(
        child=serializers.CharField(max_length=200),
        required=False,
        default=list,
        help_text="Models the key may call; empty or absent: every model its team may use.",
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None)


class ApiKeyListFilter(serializers.Serializer):
    team = serializers.SlugField(required=False)


class ApiKeyOutput(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)  # type: ignore[var-annotated]
    models = serializers.ListField(source="allowed_models", child=serializers.CharField(), read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)  # type: ignore[var-annotated]
    principal = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)  # type: ignore[var-annotated]
    revoked = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "prefix",
            "name",
            "team",
            "models",
            "principal",
            "created_by",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked",
            "revoked_at",
        ]
        read_only_fields = fields

    def get_revoked(self, key: ApiKey) -> bool:
        return key.revoked_at is not None


class ApiKeyCreatedOutput(ApiKeyOutput):
    key = serializers.CharField(help_text="The secret: shown in this response only, never again.")

    class Meta(ApiKeyOutput.Meta):
        fields = [*ApiKeyOutput.Meta.fields, "key"]
        read_only_fields = fields


def visible_keys(user: rbac.Principal) -> QuerySet[ApiKey]:
    """Keys of the teams the user may see (operators: every team's)."""
    return ApiKey.objects.filter(team__in=rbac.visible_teams(user)).select_related("team", "created_by", "principal")


def visible_key(request: Request, key_id: int) -> ApiKey:
    key = visible_keys(request.user).filter(pk=key_id).first()
    if key is None:
        raise NotFound(f"API key {key_id} not found.")
    return key


class ApiKeyListCreateApi(ListAPIView):
    """GET lists the keys of the caller's teams (`?team=` narrows), newest first; POST creates
    one (a manager of the team, or an operator) and answers with its secret, once."""

    serializer_class = ApiKeyOutput
    filter_serializer = ApiKeyListFilter

    @extend_schema(parameters=[OpenApiParameter("team", str)])
    def get(self, request: Request, *args, **kwargs) -> Response:
        return super().get(request, *args, **kwargs)

    def get_queryset(self) -> QuerySet[ApiKey]:
        filters = ApiKeyListFilter(data=self.request.query_params)
        filters.is_valid(raise_exception=True)
        keys = visible_keys(self.request.user)
        if team := filters.validated_data.get("team"):
            keys = keys.filter(team__slug=team)
        return keys

    @extend_schema(request=ApiKeyInput, responses={201: ApiKeyCreatedOutput})
    def post(self, request: Request) -> Response:
        data = ApiKeyInput(data=request.data)
        data.is_valid(raise_exception=True)
        slug = data.validated_data["team"]
        team = rbac.visible_teams(request.user).filter(slug=slug).first()
        if team is None:
            raise NotFound(f"Team {slug!r} not found.")
        rbac.require_team_manager(request.user, team)
        key, secret = api_key_create(
            team=team,
            name=data.validated_data["name"],
            models=data.validated_data["models"],
            expires_at=data.validated_data["expires_at"],
            by=request.user,
        )
        key.key = secret  # type: ignore[attr-defined]
        return Response(ApiKeyCreatedOutput(key).data, status=status.HTTP_201_CREATED)


class ApiKeyDetailApi(APIView):
    @extend_schema(responses=ApiKeyOutput)
    def get(self, request: Request, key_id: int) -> Response:
        return Response(ApiKeyOutput(visible_key(request, key_id)).data)

    @extend_schema(responses={204: None}, description="Revoke the key (a manager of its team, or an operator).")
    def delete(self, request: Request, key_id: int) -> Response:
        key = visible_key(request, key_id)
        rbac.require_team_manager(request.user, key.team)
        api_key_revoke(key=key, by=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
