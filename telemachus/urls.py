from collections.abc import Callable

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.http import HttpResponse
from django.urls import URLPattern, URLResolver, include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from executors import api as executors_api
from quotas import api as quotas_api
from quotas.spend import SpendApi
from scheduler import views as pages
from scheduler.api import views as scheduler_views
from scheduler.api.history import QueueHistoryApi
from scheduler.api.policy import PolicyApi
from telemachus.control.audit_api import AuditListApi
from telemachus.control.features_api import FeatureApi
from telemachus.http.health import healthz, readyz
from telemachus.http.schema import SchemaVisible
from telemachus.keys.api import ApiKeyDetailApi, ApiKeyListCreateApi
from telemachus.teams import api as teams_api
from telemachus.teams.signin import attempts_limited
from telemachus.teams.users_api import UserListCreateApi
from telemachus.webhooks.api import WebhookDeliveryListApi, WebhookDetailApi, WebhookListCreateApi

api = [
    path("", include("scheduler.api.urls")),
    path("queue/", scheduler_views.QueueApi.as_view(), name="queue"),
    path("queue/history/", QueueHistoryApi.as_view(), name="queue-history"),
    path("policy/", PolicyApi.as_view(), name="policy"),
    path("teams/", teams_api.TeamListCreateApi.as_view(), name="team-list"),
    path("teams/<slug:slug>/", teams_api.TeamDetailApi.as_view(), name="team-detail"),
    path("teams/<slug:slug>/grants/", teams_api.TeamGrantsApi.as_view(), name="team-grants"),
    path("teams/<slug:slug>/members/", teams_api.TeamMemberListApi.as_view(), name="team-members"),
    path("teams/<slug:slug>/members/<str:username>/", teams_api.TeamMemberDetailApi.as_view(), name="team-member"),
    path("routes/", executors_api.RouteListCreateApi.as_view(), name="route-list"),
    path("routes/<int:route_id>/", executors_api.RouteDetailApi.as_view(), name="route-detail"),
    path("executors/", executors_api.ExecutorListCreateApi.as_view(), name="executor-list"),
    path("executors/<int:executor_id>/", executors_api.ExecutorDetailApi.as_view(), name="executor-detail"),
    path("executors/<int:executor_id>/sync/", executors_api.ExecutorSyncApi.as_view(), name="executor-sync"),
    path("executors/<int:executor_id>/events/", scheduler_views.ExecutorEventListApi.as_view(), name="executor-events"),
    path("quota-policies/", quotas_api.QuotaPolicyListCreateApi.as_view(), name="quota-policy-list"),
    path("quota-policies/<int:policy_id>/", quotas_api.QuotaPolicyDetailApi.as_view(), name="quota-policy-detail"),
    path("usage/", quotas_api.UsageApi.as_view(), name="usage"),
    path("spend/", SpendApi.as_view(), name="spend"),
    path("keys/", ApiKeyListCreateApi.as_view(), name="key-list"),
    path("keys/<int:key_id>/", ApiKeyDetailApi.as_view(), name="key-detail"),
    path("webhooks/", WebhookListCreateApi.as_view(), name="webhook-list"),
    path("webhooks/<int:webhook_id>/", WebhookDetailApi.as_view(), name="webhook-detail"),
    path("webhooks/<int:webhook_id>/deliveries/", WebhookDeliveryListApi.as_view(), name="webhook-deliveries"),
    path("audit/", AuditListApi.as_view(), name="audit"),
    path("features/", FeatureApi.as_view(), name="features"),
    path("users/", UserListCreateApi.as_view(), name="user-list"),
    # Public with TELEMACHUS_PUBLIC_SCHEMA (DEBUG's default), else for signed-in callers only.
    path("schema/", SpectacularAPIView.as_view(permission_classes=[SchemaVisible]), name="schema"),
    path(  # no inline script (CSP)
        "docs/", SpectacularSwaggerSplitView.as_view(url_name="schema", permission_classes=[SchemaVisible]), name="docs"
    ),
]

# Single sign-on (OpenID Connect), when an issuer is configured: its two views, and a button on
# both sign-in pages. Without one, nothing of it is imported and the pages are as they were.
sign_in_context: dict | None = None
admin_sign_in: Callable[..., HttpResponse] = admin.site.login
sso_urls: list[URLPattern | URLResolver] = []
if settings.TELEMACHUS_OIDC_ISSUER:
    from telemachus.teams import oidc

    sign_in_context = oidc.sso_context()
    admin_sign_in = oidc.admin_sign_in
    admin.site.login_template = "admin/sso_login.html"
    sso_urls = [path("oidc/", include(oidc.urlpatterns))]

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="dashboard"), name="home"),
    path("dashboard/", pages.dashboard, name="dashboard"),
    path("metrics", pages.metrics, name="metrics"),
    path("favicon.ico", pages.favicon, name="favicon"),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path(
        "login/",
        attempts_limited(
            auth_views.LoginView.as_view(template_name="scheduler/login.html", extra_context=sign_in_context)  # type: ignore[arg-type]
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/login/", attempts_limited(admin_sign_in)),
    *sso_urls,
    path("admin/", admin.site.urls),
    path("api/", include(api)),  # type: ignore[arg-type]
]
