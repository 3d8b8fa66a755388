"""/api/webhooks/: a team's webhooks and their deliveries. A team's managers and operators see and
manage them; to anyone else they do not exist (404). The secret is in the creating answer only."""

from typing import Any

from django.db.models import Prefetch, QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from telemachus.errors import NotFound
from telemachus.http.serializers import StrictSerializer
from telemachus.models import Membership, Team
from telemachus.teams import rbac
from telemachus.webhooks.models import Webhook, WebhookAttempt, WebhookDelivery
from telemachus.webhooks.services import EVENTS, webhook_create, webhook_delete, webhook_update


def managed_teams(user: rbac.Principal) -> QuerySet[Team]:
    """The teams whose webhooks the user may see and manage: all for operators, else those the
    user manages."""
    if rbac.is_operator(user):
        return Team.objects.all()
    if not user.is_authenticated:
        return Team.objects.none()
    return Team.objects.filter(memberships__user=user, memberships__role=Membership.Role.MANAGER)


def visible_webhook(request: Request, webhook_id: int) -> Webhook:
    webhook = (
        Webhook.objects.filter(team__in=managed_teams(request.user), pk=webhook_id)
        .select_related("team", "created_by")
        .first()
    )
    if webhook is None:
        raise NotFound(f"Webhook {webhook_id} not found.")
    return webhook


class WebhookInput(StrictSerializer):
    team = serializers.SlugField(max_length=64)
    url = serializers.URLField(max_length=2000)
    events = serializers.ListField(child=serializers.ChoiceField(choices=EVENTS), min_length=1)
    description = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)


class WebhookUpdateInput(StrictSerializer):
    url = serializers.URLField(max_length=2000, required=False)
    events = serializers.ListField(child=serializers.ChoiceField(choices=EVENTS), min_length=1, required=False)
    enabled = serializers.BooleanField(required=False)
    description = serializers.CharField(max_length=200, required=False, allow_blank=True)


class WebhookListFilter(serializers.Serializer):
    team = serializers.SlugField(required=False)


class WebhookOutput(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)  # type: ignore[var-annotated]
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)  # type: ignore[var-annotated]

    class Meta:
        model = Webhook
        fields = ["id", "team", "url", "events", "description", "enabled", "created_by", "created_at"]
        read_only_fields = fields


class WebhookCreatedOutput(WebhookOutput):
    secret = serializers.CharField(
        help_text="The signing secret (Standard Webhooks, `whsec_...`): shown in this response only, never again."
    )

    class Meta(WebhookOutput.Meta):
        fields = [*WebhookOutput.Meta.fields, "secret"]
        read_only_fields = fields


class WebhookAttemptOutput(serializers.ModelSerializer):
    class Meta:
        model = WebhookAttempt
        fields = ["at", "duration_ms", "status_code", "response_excerpt", "error"]
        read_only_fields = fields


class WebhookDeliveryOutput(serializers.ModelSerializer):
    attempt_log = WebhookAttemptOutput(many=True, read_only=True)

    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "message_id",
            "event",
            "status",
            "attempts",
            "created_at",
            "next_attempt_at",
            "delivered_at",
            "payload",
            "attempt_log",
        ]
        read_only_fields = fields


class WebhookListCreateApi(ListAPIView):
    """GET lists the webhooks of the teams the caller manages (`?team=` narrows), newest first;
    POST registers one (a manager of the team, or an operator) and answers with its secret, once."""

    serializer_class = WebhookOutput
    filter_serializer = WebhookListFilter

    @extend_schema(parameters=[OpenApiParameter("team", str)])
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)

    def get_queryset(self) -> QuerySet[Webhook]:
        filters = WebhookListFilter(data=self.request.query_params)
        filters.is_valid(raise_exception=True)
        hooks = Webhook.objects.filter(team__in=managed_teams(self.request.user)).select_related("team", "created_by")
        if team := filters.validated_data.get("team"):
            hooks = hooks.filter(team__slug=team)
        return hooks

    @extend_schema(request=WebhookInput, responses={201: WebhookCreatedOutput})
    def post(self, request: Request) -> Response:
        data = WebhookInput(data=request.data)
        data.is_valid(raise_exception=True)
        slug = data.validated_data["team"]
        team = rbac.visible_teams(request.user).filter(slug=slug).first()
        if team is None:
            raise NotFound(f"Team {slug!r} not found.")
        rbac.require_team_manager(request.user, team)
        webhook, secret = webhook_create(
            team=team,
            url=data.validated_data["url"],
            events=data.validated_data["events"],
            description=data.validated_data["description"],
            by=request.user,
        )
        body = {**WebhookCreatedOutput(webhook).data, "secret": secret}
        return Response(body, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class WebhookDetailApi(APIView):
    @extend_schema(responses=WebhookOutput)
    def get(self, request: Request, webhook_id: int) -> Response:
        return Response(WebhookOutput(visible_webhook(request, webhook_id)).data)

    @extend_schema(request=WebhookUpdateInput, responses=WebhookOutput)
    def patch(self, request: Request, webhook_id: int) -> Response:
        webhook = visible_webhook(request, webhook_id)
        data = WebhookUpdateInput(data=request.data)
        data.is_valid(raise_exception=True)
        webhook = webhook_update(webhook=webhook, by=request.user, **data.validated_data)
        return Response(WebhookOutput(webhook).data)

    @extend_schema(responses={204: None}, description="Delete the webhook and its deliveries.")
    def delete(self, request: Request, webhook_id: int) -> Response:
        webhook_delete(webhook=visible_webhook(request, webhook_id), by=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookDeliveryListApi(ListAPIView):
    """GET the webhook's deliveries, newest first, each with its attempts: when, how long, the
    receiver's status and the start of its answer, or why nothing was sent or answered."""

    serializer_class = WebhookDeliveryOutput

    def get_queryset(self) -> QuerySet[WebhookDelivery]:
        webhook = visible_webhook(self.request, self.kwargs["webhook_id"])
        return WebhookDelivery.objects.filter(webhook=webhook).prefetch_related(
            Prefetch("attempt_log", queryset=WebhookAttempt.objects.order_by("id"))
        )
