"""GET / POST /api/users/: operators list and create users (then add them to teams)."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db.models import Exists, OuterRef, Q, QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from telemachus.http.serializers import StrictSerializer
from telemachus.teams import rbac
from telemachus.teams.users import user_create


class UserInput(StrictSerializer):
    username = serializers.RegexField(r"^[\w.@+-]+\Z", max_length=150)
    email = serializers.EmailField(required=False, default="")
    password = serializers.CharField(
        required=False,
        write_only=True,
        trim_whitespace=False,
        help_text="Omit to invite: the user signs in with the token until one is set.",
    )
    operator = serializers.BooleanField(default=False, help_text="Grant scheduler.manage.")
    token = serializers.BooleanField(default=True, help_text="Create an API token and return it (once).")


class UserOutput(serializers.Serializer):
    username = serializers.CharField(source="get_username")
    email = serializers.CharField(help_text="Empty when none was given.")
    operator = serializers.SerializerMethodField()
    invited = serializers.SerializerMethodField()
    teams = serializers.SerializerMethodField()

    def get_operator(self, user) -> bool:
        if hasattr(user, "manages"):  # annotated by the list's query
            return bool(user.is_active and (user.is_superuser or user.manages))
        return rbac.is_operator(user)

    def get_invited(self, user) -> bool:
        return not user.has_usable_password()

    def get_teams(self, user) -> dict[str, str]:
        return {m.team.slug: m.role for m in user.memberships.all()}


class UserCreatedOutput(UserOutput):
    token = serializers.CharField(allow_null=True)


class UserListCreateApi(ListAPIView):
    serializer_class = UserOutput

    def get_queryset(self) -> QuerySet:
        rbac.require_operator(self.request.user)
        manage = Permission.objects.filter(content_type__app_label="scheduler", codename="manage").filter(
            Q(user=OuterRef("pk")) | Q(group__user=OuterRef("pk"))
        )
        return get_user_model().objects.annotate(manages=Exists(manage)).prefetch_related("memberships__team")

    @extend_schema(request=UserInput, responses={201: UserCreatedOutput})
    def post(self, request: Request) -> Response:
        rbac.require_operator(request.user)
        data = UserInput(data=request.data)
        data.is_valid(raise_exception=True)
        user, token = user_create(**data.validated_data, by=request.user)
        user.token = token  # type: ignore[attr-defined]
        return Response(UserCreatedOutput(user).data, status=status.HTTP_201_CREATED)
