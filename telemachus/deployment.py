"""What `manage.py telemachus_check` checks: the configuration a deployer sets, against what a
production instance needs, with every service it names actually reached. Each finding is `ok`, a
`warning` (works, but probably not as meant) or a `problem` (something will fail: the command exits
non-zero). docs/configuration.md lists the settings and what happens at start-up."""

from dataclasses import dataclass
from pathlib import Path

import psycopg
import redis
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, connection
from django.db.migrations.executor import MigrationExecutor

from telemachus.environment import one_line
from telemachus.startup import database_described, database_route_check, tls_redirect_loop

DEFAULT_ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]


@dataclass(frozen=True)
class Finding:
    level: str  # "ok", "warning" or "problem"
    topic: str
    text: str


def deployment_findings() -> list[Finding]:
    """Every check, in the order a deployer would fix them. Opens and closes its own connections
    (to the database, its LISTEN address behind a pooler, and Redis); writes nothing."""
    findings = [Finding("problem", "environment", line) for line in settings.ENVIRONMENT_MISSPELLED]
    findings += _django_deploy_checks()
    database = _database()
    findings += database
    if all(f.level != "problem" for f in database):
        findings.append(_migrations())
    findings += [_redis(), _secret_key(), _allowed_hosts(), _tls(), _static_files(), _schema()]
    return findings


def _django_deploy_checks() -> list[Finding]:
    """Django's `check --deploy` (database checks aside: the database is checked below)."""
    messages = [
        m
        for m in checks.run_checks(include_deployment_checks=True)
        if m.level >= checks.WARNING and not m.is_silenced()
    ]
    if not messages:
        return [Finding("ok", "django", "check --deploy: no issues")]
    return [
        Finding("problem", "django", f"{m.id}: {' '.join(str(m.msg).split())}" + (f" ({m.hint})" if m.hint else ""))
        for m in messages
    ]


def _database() -> list[Finding]:
    described = database_described(connection.settings_dict)
    try:
        route = database_route_check()
    except ImproperlyConfigured as exc:
        return [Finding("problem", "database", f"{described}: {one_line(exc)}")]
    if not route.reachable:
        return [Finding("problem", "database", f"{described}: {route.note}")]
    found = [Finding("ok", "database", f"{described} answers, {route.note}")]
    return found + [Finding("warning", "database", warning) for warning in route.warnings]


def _migrations() -> Finding:
    try:
        executor = MigrationExecutor(connection)
        pending = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except (DatabaseError, psycopg.Error) as exc:
        return Finding("problem", "migrations", f"cannot read them: {one_line(exc)}")
    finally:
        connection.close()
    if pending:
        names = ", ".join(f"{m.app_label}.{m.name}" for m, _ in pending[:5])
        return Finding("problem", "migrations", f"{len(pending)} not applied ({names}): run manage.py migrate")
    return Finding("ok", "migrations", "all applied")


def _redis() -> Finding:
    if not settings.REDIS_URL:
        return Finding(
            "ok",
            "redis",
            "not set: live events stay within a process and throttle and sign-in counts are per process, "
            "which is right for one API process only (set REDIS_URL with several)",
        )
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=5, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        return Finding("problem", "redis", f"REDIS_URL does not answer: {one_line(exc)}")
    finally:
        client.close()
    return Finding("ok", "redis", f"answers; keys prefixed {settings.REDIS_PREFIX!r}")


def _secret_key() -> Finding:
    key = settings.SECRET_KEY
    if key == settings.DEVELOPMENT_SECRET_KEY:
        return Finding("problem", "secret key", "SECRET_KEY is not set: the development key is in use (DEBUG on)")
    if len(key) < 50 or len(set(key)) < 5:
        return Finding(
            "problem",
            "secret key",
            f"SECRET_KEY is weak ({len(key)} characters, {len(set(key))} distinct; at least 50 and 5): generate "
            "one with `python3 -c 'import secrets; print(secrets.token_urlsafe(50))'`",
        )
    return Finding("ok", "secret key", f"set, {len(key)} characters; {len(settings.SECRET_KEY_FALLBACKS)} fallbacks")


def _allowed_hosts() -> Finding:
    hosts = settings.ALLOWED_HOSTS
    if "*" in hosts:
        return Finding(
            "problem",
            "allowed hosts",
            "ALLOWED_HOSTS has '*': any Host header is believed (links the app builds, the dashboard socket's "
            "origin check): list the names clients use",
        )
    if not settings.DEBUG and (not hosts or hosts == DEFAULT_ALLOWED_HOSTS):
        return Finding(
            "problem",
            "allowed hosts",
            f"ALLOWED_HOSTS is {','.join(hosts) or 'empty'}: with DEBUG off every request for another name (the one "
            "clients and the proxy use) answers 400: set ALLOWED_HOSTS to those names, comma-separated",
        )
    return Finding("ok", "allowed hosts", ",".join(hosts))


def _tls() -> Finding:
    if settings.DEBUG:
        return Finding("ok", "tls", "DEBUG on: no HTTPS redirect, cookies not marked secure")
    loop = tls_redirect_loop()
    if loop:
        return Finding("problem", "tls", loop)
    if settings.SECURE_PROXY_SSL_HEADER:
        return Finding(
            "ok",
            "tls",
            "behind a TLS proxy (BEHIND_TLS_PROXY): its X-Forwarded-Proto and last X-Forwarded-For are trusted; "
            "make sure clients cannot reach this server around it",
        )
    return Finding("ok", "tls", "no HTTPS redirect (SECURE_SSL_REDIRECT=0)")


def _static_files() -> Finding:
    if settings.DEBUG:
        return Finding("ok", "static files", "served from the apps (DEBUG on)")
    manifest = Path(settings.STATIC_ROOT) / "staticfiles.json"
    if not manifest.exists():
        return Finding(
            "problem",
            "static files",
            f"{manifest} is missing: the admin and the dashboard would answer 500; run "
            "manage.py collectstatic --noinput",
        )
    return Finding("ok", "static files", f"collected in {settings.STATIC_ROOT}")


def _schema() -> Finding:
    if settings.TELEMACHUS_PUBLIC_SCHEMA and not settings.DEBUG:
        return Finding("warning", "schema", "/api/schema/ and /api/docs/ are public (TELEMACHUS_PUBLIC_SCHEMA=1)")
    return Finding(
        "ok", "schema", "public" if settings.TELEMACHUS_PUBLIC_SCHEMA else "for signed-in callers only (401 otherwise)"
    )
