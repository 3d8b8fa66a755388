"""Pages outside the API: the live dashboard (its data comes over /ws/dashboard/), /metrics and
/favicon.ico."""

import json
from functools import cache
from pathlib import Path

from django.contrib.auth.decorators import login_required
from django.contrib.staticfiles import finders
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET
from rest_framework.authentication import SessionAuthentication
from rest_framework.exceptions import AuthenticationFailed, Throttled
from rest_framework.request import Request

from scheduler.live.snapshot import POLICY_HELP
from scheduler.metrics import metrics_exposition
from telemachus.keys.authentication import CredentialAuthentication
from telemachus.teams import rbac


@login_required
def dashboard(request: HttpRequest) -> HttpResponse:
    return render(request, "scheduler/dashboard.html", {"policy_help": json.dumps(POLICY_HELP)})


@cache
def _favicon() -> bytes:
    return Path(str(finders.find("scheduler/favicon.svg"))).read_bytes()


@require_GET
def favicon(request: HttpRequest) -> HttpResponse:
    """GET /favicon.ico: the site's icon (the SVG the dashboard's pages link), for the pages that
    link none (the admin, the API's own) and for browsers that ask the conventional path. Served
    from here, not a CDN; browsers go by the content type, not the name."""
    return HttpResponse(_favicon(), content_type="image/svg+xml", headers={"Cache-Control": "public, max-age=86400"})


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """GET /metrics: Prometheus text, for operators (token or session). For a scraper without a
    token, a worker serves the same on TELEMACHUS_METRICS_BIND."""
    try:
        user = Request(request, authenticators=[CredentialAuthentication(), SessionAuthentication()]).user
    except (AuthenticationFailed, Throttled):
        user = None
    if user is None or not user.is_authenticated:
        return JsonResponse(
            {"error": "not_authenticated", "detail": "Authentication credentials were not provided."},
            status=401,
            headers={"WWW-Authenticate": "Token"},
        )
    if not rbac.is_operator(user):
        return JsonResponse(
            {
                "error": "forbidden",
                "detail": f"Requires the {rbac.MANAGE_PERMISSION} permission.",
                "permission": rbac.MANAGE_PERMISSION,
            },
            status=403,
        )
    body, content_type = metrics_exposition(request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)
