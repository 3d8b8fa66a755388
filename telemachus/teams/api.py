from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from telemachus.errors import NotFound
from telemachus.http.serializers import StrictSerializer
from telemachus.models import Membership, Team
from telemachus.teams import rbac
from telemachus.teams.services import (
    team_create,
    team_delete,
    team_grants,
    team_grants_set,
    team_member_remove,
    team_member_set,
    team_update,
)


class MemberInput(StrictSerializer):
    username = serializers.CharField(max_length=150)
    role = serializers.ChoiceField(choices=Membership.Role.choices, default=Membership.Role.MEMBER)


PERMISSION_CHOICES = list(rbac.PERMISSIONS)


class TeamCreateInput(StrictSerializer):
    slug = serializers.SlugField(max_length=64)
    name = serializers.CharField(max_length=200)
    members = MemberInput(many=True, required=False)
    grants = serializers.ListField(
        child=serializers.ChoiceField(choices=PERMISSION_CHOICES),
        required=False,
        help_text="Permissions the team grants every member (default: chat:use).",
    )


class GrantsInput(StrictSerializer):
    team = serializers.ListField(child=serializers.ChoiceField(choices=PERMISSION_CHOICES))
    users = serializers.DictField(
        child=serializers.ListField(child=serializers.ChoiceField(choices=PERMISSION_CHOICES)), required=False
    )


# A year and more, in hours: a longer retention is a mistake, not a policy.
RETENTION_MAX_HOURS = 100_000


class TeamUpdateInput(StrictSerializer):
    name = serializers.CharField(max_length=200, required=False)
    retention_hours = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=RETENTION_MAX_HOURS,
        help_text="Hours the team's finished jobs are kept; null: the deployment's (TELEMACHUS_RETENTION_HOURS).",
    )
    body_retention_hours = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=RETENTION_MAX_HOURS,
        help_text="Hours a finished job keeps its prompt and answer (0: removed as soon as it ends); "
        "null: as long as the job.",
    )


class MemberOutput(serializers.Serializer):
    username = serializers.CharField(source="user.username")
    role = serializers.CharField()


class TeamOutput(serializers.ModelSerializer):
    members = MemberOutput(source="memberships", many=True, read_only=True)
    grants = serializers.SerializerMethodField()

    class Meta:
        model = Team
        fields = ["slug", "name", "members", "grants", "retention_hours", "body_retention_hours", "created_at"]
        read_only_fields = fields

    def get_grants(self, team: Team) -> dict:
        return team_grants(team=team)


def visible_team(request: Request, slug: str) -> Team:
    team = rbac.visible_teams(request.user).filter(slug=slug).first()
    if team is None:
        raise NotFound(f"Team {slug!r} not found.")
    return team


def team_queryset(teams: QuerySet[Team]) -> QuerySet[Team]:
    return teams.prefetch_related("memberships__user")


class TeamListCreateApi(ListAPIView):
    """Operators see and create every team; other users see the teams they belong to."""

    serializer_class = TeamOutput

    def get_queryset(self) -> QuerySet[Team]:
        return team_queryset(rbac.visible_teams(self.request.user))

    @extend_schema(request=TeamCreateInput, responses={201: TeamOutput})
    def post(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = TeamCreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        team = team_create(by=request.user, **data.validated_data)
        return Response(TeamOutput(team_queryset(Team.objects).get(pk=team.pk)).data, status=status.HTTP_201_CREATED)  # type: ignore[arg-type]


class TeamDetailApi(APIView):
    @extend_schema(responses=TeamOutput)
    def get(self, request: Request, slug: str) -> Response:
        return Response(TeamOutput(visible_team(request, slug)).data)

    @extend_schema(request=TeamUpdateInput, responses=TeamOutput)
    def patch(self, request: Request, slug: str) -> Response:
        team = visible_team(request, slug)
        rbac.require_operator(request.user)
        data = TeamUpdateInput(data=request.data)
        data.is_valid(raise_exception=True)
        return Response(TeamOutput(team_update(team=team, by=request.user, **data.validated_data)).data)

    @extend_schema(responses={204: None})
    def delete(self, request: Request, slug: str) -> Response:
        team = visible_team(request, slug)
        rbac.require_operator(request.user)
        team_delete(team=team, by=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class TeamGrantsApi(APIView):
    """What the team grants its members (all of them, through its group) and single users."""

    @extend_schema(request=GrantsInput, responses=GrantsInput)
    def put(self, request: Request, slug: str) -> Response:
        team = visible_team(request, slug)
        rbac.require_operator(request.user)
        data = GrantsInput(data=request.data)
        data.is_valid(raise_exception=True)
        team_grants_set(
            team=team,
            team_grants=data.validated_data["team"],
            user_grants=data.validated_data.get("users"),
            by=request.user,
        )
        return Response(team_grants(team=team))


class TeamMemberListApi(APIView):
    """Operators and the team's managers manage its members."""

    @extend_schema(request=MemberInput, responses={201: MemberOutput})
    def post(self, request: Request, slug: str) -> Response:
        team = visible_team(request, slug)
        rbac.require_team_manager(request.user, team)
        data = MemberInput(data=request.data)
        data.is_valid(raise_exception=True)
        rbac.member_candidate(request.user, data.validated_data["username"])
        membership = team_member_set(team=team, by=request.user, **data.validated_data)
        return Response(MemberOutput(membership).data, status=status.HTTP_201_CREATED)


class TeamMemberDetailApi(APIView):
    @extend_schema(responses={204: None})
    def delete(self, request: Request, slug: str, username: str) -> Response:
        team = visible_team(request, slug)
        rbac.require_team_manager(request.user, team)
        user = get_user_model().objects.filter(username=username, memberships__team=team).first()
        if user is None:
            raise NotFound(f"{username!r} is not a member of {slug!r}.")
        team_member_remove(team=team, user=user, by=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
