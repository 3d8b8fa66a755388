"""Liveness and readiness, for load balancers and orchestrators.

GET /healthz answers while the process runs (no database call). GET /readyz answers 200 only when
the database answers, as the settings expect it to (not through a connection pooler they do not
know of: telemachus/db/pooler.py), and every migration is applied; a worker's own probe server adds a
recent heartbeat (scheduler/worker/probes.py). Both JSON; no authentication, and nothing in them
that needs it."""

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.migrations.executor import MigrationExecutor
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from telemachus.db.pooler import database_ping

# Migrations, once all applied, stay applied: checked until the first success, then remembered.
_migrated = False


def readiness_checks() -> dict[str, str]:
    """ "ok" or what is wrong, per check: the database, the migrations."""
    global _migrated
    checks: dict[str, str] = {}
    try:
        pooled = database_ping()
    except DatabaseError as exc:
        checks["database"] = f"unreachable: {exc}".strip()[:300]
        checks["migrations"] = "unknown"
        return checks
    if pooled and not settings.TELEMACHUS_PGBOUNCER:
        checks["database"] = (
            "reached through a connection pooler but TELEMACHUS_PGBOUNCER is off: set TELEMACHUS_PGBOUNCER=1 "
            "and TELEMACHUS_LISTEN_DATABASE_URL (PostgreSQL itself)"
        )
        checks["migrations"] = "unknown"
        return checks
    checks["database"] = "ok"
    if not _migrated:
        executor = MigrationExecutor(connection)
        pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
        _migrated = not pending
        if pending:
            names = ", ".join(f"{m.app_label}.{m.name}" for m, _ in pending[:5])
            checks["migrations"] = f"{len(pending)} not applied ({names})"
            return checks
    checks["migrations"] = "ok"
    return checks


def readiness_response(checks: dict[str, str]) -> JsonResponse:
    ready = all(value == "ok" for value in checks.values())
    return JsonResponse({"status": "ok" if ready else "unavailable", "checks": checks}, status=200 if ready else 503)


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    return readiness_response(readiness_checks())
