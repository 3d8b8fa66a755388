"""What the API server and the worker check and say as they start.

Each prints a banner naming what it serves: the database (engine, user, host, port, name; never
the password) and how it reaches it (directly, or through a pooler), the server, Redis or none,
and where its metrics go, so a process started against the wrong database (a DATABASE_URL that
was not exported in this shell) says so in its first lines. Each refuses to start, with one line
naming the setting and the fix, when the set-up cannot serve: DATABASE_URL through a connection
pooler without TELEMACHUS_PGBOUNCER, LISTEN through the pooler, the worker's session setting
refused (telemachus/db/pooler.py). A database that does not answer yet is not a refusal: the
process starts, says so, and /readyz answers 503 until it does.

A refusal is an ImproperlyConfigured, which manage.py and telemachus/serve.py print as that one
line (telemachus/environment.py, `configuration_errors_reported`)."""

from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connection, connections

from telemachus.control.notify import listen_connection_params
from telemachus.db.pooler import listen_pooled, pooler_unflagged, route_probe, startup_parameter_refused
from telemachus.environment import one_line, url_without_password


def database_described(config: dict[str, Any]) -> str:
    """The database as the banner names it: engine and where, never the password."""
    if config["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite {config['NAME']}"
    user = f"{config['USER']}@" if config.get("USER") else ""
    host = config.get("HOST") or "local socket"
    sslmode = (config.get("OPTIONS") or {}).get("sslmode")
    return f"postgresql {user}{host}:{config.get('PORT') or 5432}/{config['NAME']}" + (
        f" (sslmode={sslmode})" if sslmode else ""
    )


@dataclass
class DatabaseRoute:
    """How this process reaches its database, for the banner and telemachus_check."""

    note: str
    reachable: bool
    warnings: list[str] = field(default_factory=list)


def database_route_check(*, worker_database: dict[str, Any] | None = None) -> DatabaseRoute:
    """Connect as this process will (a worker: with `worker_database`, its own connection
    settings, session setting included) and find whether it goes through a pooler. Raises
    ImproperlyConfigured when the set-up cannot serve (telemachus/db/pooler.py says why)."""
    config = worker_database or connection.settings_dict
    if config["ENGINE"] != "django.db.backends.postgresql":
        note = "embedded: one host only" if not settings.TELEMACHUS_PGBOUNCER else "TELEMACHUS_PGBOUNCER ignored"
        return DatabaseRoute(note=note, reachable=True)
    where = f"{config.get('HOST') or 'local socket'}:{config.get('PORT') or 5432}"
    user, name = config.get("USER") or "", config["NAME"]
    try:
        route = route_probe(connections[DEFAULT_DB_ALIAS].__class__(config).get_connection_params())
    except psycopg.OperationalError as exc:
        if startup_parameter_refused(exc):
            symptom = f"it refused the worker's session setting: {one_line(exc).rpartition('FATAL:')[2].strip()}"
            raise ImproperlyConfigured(
                pooler_unflagged(where=where, route=None, user=user, name=name, symptom=symptom)
            ) from None
        return DatabaseRoute(note=f"not answering yet ({one_line(exc)})", reachable=False)
    if route.pooled and not settings.TELEMACHUS_PGBOUNCER:
        raise ImproperlyConfigured(pooler_unflagged(where=where, route=route, user=user, name=name))
    if not route.pooled:
        if settings.TELEMACHUS_PGBOUNCER:
            return DatabaseRoute(
                note="direct",
                reachable=True,
                warnings=[
                    "TELEMACHUS_PGBOUNCER=1 but DATABASE_URL reaches PostgreSQL directly: harmless, but statements "
                    "are not prepared (a sixth more PostgreSQL CPU per /v1/ call); unset it unless a pooler "
                    "will be put in between"
                ],
            )
        return DatabaseRoute(note="direct", reachable=True)
    try:
        listen = route_probe(listen_connection_params())
    except psycopg.OperationalError as exc:
        return DatabaseRoute(
            note="through a connection pooler (TELEMACHUS_PGBOUNCER=1)",
            reachable=True,
            warnings=[f"the LISTEN connection (TELEMACHUS_LISTEN_DATABASE_URL) fails: {one_line(exc)}"],
        )
    if listen.pooled:
        raise ImproperlyConfigured(
            listen_pooled(
                where=where,
                listen_url_set=bool(settings.TELEMACHUS_LISTEN_DATABASE_URL),
                route=route,
                user=user,
                name=name,
            )
        )
    return DatabaseRoute(
        note=f"through a connection pooler (TELEMACHUS_PGBOUNCER=1), LISTEN straight to PostgreSQL at {listen.server}",
        reachable=True,
    )


def tls_redirect_loop() -> str | None:
    """With DEBUG off the app redirects every plain-HTTP request to https:// (SECURE_SSL_REDIRECT)
    and marks cookies secure; the server speaks plain HTTP only, so that works behind a TLS proxy
    whose X-Forwarded-Proto the app trusts (BEHIND_TLS_PROXY) and nowhere else: every page would
    redirect to itself, and sign-in never keep its cookie."""
    if settings.SECURE_SSL_REDIRECT and not settings.SECURE_PROXY_SSL_HEADER:
        return (
            "SECURE_SSL_REDIRECT is on but BEHIND_TLS_PROXY is off: this server speaks plain HTTP, so every page "
            "would redirect to https:// and come back as http: behind a TLS proxy that sets X-Forwarded-Proto set "
            "BEHIND_TLS_PROXY=1; without TLS (a trusted network only) set SECURE_SSL_REDIRECT=0 "
            "SESSION_COOKIE_SECURE=0 CSRF_COOKIE_SECURE=0"
        )
    return None


def redis_described() -> str:
    if not settings.REDIS_URL:
        return "none: in-memory channel layer, throttle and sign-in counts per process (one API process only)"
    return f"{url_without_password(settings.REDIS_URL)}, keys prefixed {settings.REDIS_PREFIX!r}"


def metrics_described(*, worker: bool) -> str:
    directory = next((s.shown for s in settings.ENVIRONMENT_READ if s.name == "PROMETHEUS_MULTIPROC_DIR"), "")
    where = (
        f"{directory} (PROMETHEUS_MULTIPROC_DIR: every process of this host, merged by the API's /metrics)"
        if directory != "(not set)"
        else "this process only (PROMETHEUS_MULTIPROC_DIR not set)"
    )
    if worker:
        bind = settings.TELEMACHUS_METRICS_BIND
        where += f"; served on http://{bind}/metrics" if bind else "; not served (TELEMACHUS_METRICS_BIND not set)"
    return where


def startup_banner(*, role: str, worker_database: dict[str, Any] | None = None) -> list[str]:
    """The banner's lines for `role` ("API on http://...", "worker NAME"), after the checks that
    may refuse the start (ImproperlyConfigured). Opens and closes its own connections."""
    route = database_route_check(worker_database=worker_database)
    database = database_described(connection.settings_dict)
    if not settings.DATABASE_URL:
        database += " (DATABASE_URL not set: the development default)"
    warnings = [*settings.ENVIRONMENT_MISSPELLED, *route.warnings]
    if not settings.DEBUG and (loop := tls_redirect_loop()):
        warnings.append(loop)
    if not route.reachable:
        warnings.append("the database does not answer yet: starting anyway; /readyz answers 503 until it does")
    lines = [
        f"Telemachus {role} (DEBUG {'on' if settings.DEBUG else 'off'})",
        f"  database  {database}, {route.note}",
        f"  redis     {redis_described()}",
        f"  metrics   {metrics_described(worker=worker_database is not None)}",
    ]
    return lines + [f"  warning   {warning}" for warning in warnings]
