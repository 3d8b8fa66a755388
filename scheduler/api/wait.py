"""GET /api/jobs/{id}/wait/?timeout=S: a long poll that answers when the job ends or the timeout
passes, whichever is first, with the job as GET /api/jobs/{id}/ shows it.

A native async view (DRF views are synchronous and would hold one of daphne's threads for the
whole wait); authentication, visibility and serialization are the API's own, run in a thread."""

import asyncio
import time

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.authentication import SessionAuthentication, TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from scheduler.api.serializers import JobOutput
from scheduler.models import Job
from telemachus import rbac

DEFAULT_TIMEOUT, MAX_TIMEOUT, POLL_SECONDS = 30.0, 300.0, 0.2


def _authenticate(request: HttpRequest) -> rbac.Principal | None:
    try:
        user = Request(request, authenticators=[TokenAuthentication(), SessionAuthentication()]).user
    except AuthenticationFailed:
        return None
    return user if user.is_authenticated else None


def _job(user: rbac.Principal, job_id: int) -> dict | None:
    job = rbac.visible_jobs(user).select_related("team", "user", "executor").filter(pk=job_id).first()
    return None if job is None else JobOutput(job).data


def _status(user: rbac.Principal, job_id: int) -> str | None:
    return rbac.visible_jobs(user).filter(pk=job_id).values_list("status", flat=True).first()


@csrf_exempt  # reads only; token clients send no CSRF token, and a POST here must be a 405, not a 403
async def job_wait(request: HttpRequest, job_id: int) -> JsonResponse:
    if request.method != "GET":
        return JsonResponse({"error": "method_not_allowed", "detail": f"Method {request.method} not allowed."}, status=405)
    user = await sync_to_async(_authenticate)(request)
    if user is None:
        return JsonResponse({"error": "not_authenticated", "detail": "Authentication credentials were not provided."},
                            status=401)
    try:
        timeout = float(request.GET.get("timeout", DEFAULT_TIMEOUT))
        if not 0 <= timeout <= MAX_TIMEOUT:
            raise ValueError
    except ValueError:
        return JsonResponse({"error": "validation_error", "detail": "Invalid input.",
                             "fields": {"timeout": [f"A number of seconds from 0 to {MAX_TIMEOUT:.0f}."]}}, status=400)
    deadline = time.monotonic() + timeout
    while True:
        status = await sync_to_async(_status)(user, job_id)
        if status is None:
            return JsonResponse({"error": "not_found", "detail": f"Job {job_id} not found."}, status=404)
        if status in Job.TERMINAL or time.monotonic() >= deadline:
            data = await sync_to_async(_job)(user, job_id)
            if data is not None:
                return JsonResponse(data)
        await asyncio.sleep(min(POLL_SECONDS, max(deadline - time.monotonic(), 0)))
