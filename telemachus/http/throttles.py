"""Per-user API throttles (DRF), on the operations that create work."""

from django.conf import settings
from rest_framework.request import Request
from rest_framework.throttling import UserRateThrottle
from rest_framework.views import APIView


class SubmitRateThrottle(UserRateThrottle):
    """Job submissions per user (per address for anonymous callers, who are refused anyway), at
    TELEMACHUS_SUBMIT_RATE ("100/s", "600/min", ...; empty turns it off). Only POSTs count: reading
    lists and jobs is never throttled. Over the rate: 429 `throttled` with Retry-After. The
    counts live in Django's cache (shared through Redis when REDIS_URL is set)."""

    scope = "submit"

    def get_rate(self) -> str | None:
        return settings.TELEMACHUS_SUBMIT_RATE or None

    def allow_request(self, request: Request, view: APIView) -> bool:
        if request.method != "POST":
            return True
        return super().allow_request(request, view)
