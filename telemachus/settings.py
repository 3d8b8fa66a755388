"""Settings, all from the environment (12-factor).

Every knob has a safe default for `make run` on one machine (SQLite under var/, in-memory channel
layer); production sets DATABASE_URL, REDIS_URL, SECRET_KEY, DEBUG=0 and ALLOWED_HOSTS.
"""

import re
from pathlib import Path

import dj_database_url
import django
from csp.constants import NONCE, NONE, SELF
from django.core.exceptions import ImproperlyConfigured

from telemachus.environment import (
    env_bool,
    env_choice,
    env_counts,
    env_float,
    env_int,
    env_list,
    env_note,
    env_rate,
    env_str,
    environment_misspelled,
    environment_misspellings,
    environment_read,
    url_without_password,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("TELEMACHUS_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", True)
# The key a development run uses when SECRET_KEY is unset (DEBUG on only); telemachus_check flags it.
DEVELOPMENT_SECRET_KEY = "dev-insecure-telemachus-key-only-for-local-runs"
SECRET_KEY = env_str("SECRET_KEY", secret=True)
if not SECRET_KEY:
    if not DEBUG:
        misspelled = "".join(f" ({name} is set: a misspelling?)" for name in environment_misspellings("SECRET_KEY"))
        raise ImproperlyConfigured(
            f"SECRET_KEY must be set when DEBUG is off{misspelled}: generate one with "
            "`python3 -c 'import secrets; print(secrets.token_urlsafe(50))'` and give every API and worker "
            "host the same, or set DEBUG=1 for a development run"
        )
    SECRET_KEY = DEVELOPMENT_SECRET_KEY
# Earlier SECRET_KEYs, comma-separated, while rotating: API keys and tokens (stored as digests keyed
# by it, telemachus/keys/digests.py), sessions and signatures made under them keep working.
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS", [], secret=True)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
CSRF_FAILURE_VIEW = "telemachus.http.errors.csrf_failure"

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "guardian",
    "channels",
    "telemachus",
    "executors",
    "quotas",
    "scheduler",
]
# A deployment's own apps (their `tasks.py` declare Django tasks that workers may run), comma-separated.
INSTALLED_APPS += env_list("TELEMACHUS_APPS", [])
if django.VERSION < (6, 0):
    # Django 6 has the tasks API built in; on 5.2 the django-tasks package brings it, as an app
    # (its system checks and log receivers).
    INSTALLED_APPS.append("django_tasks")

MIDDLEWARE = [
    # First, so errors raised by any middleware below under /api/ and /v1/ are JSON too.
    "telemachus.http.errors.ApiErrorMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "telemachus.http.middleware.AuditSourceMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
]

ROOT_URLCONF = "telemachus.urls"
ASGI_APPLICATION = "telemachus.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The project's templates (dashboard, sign-in, admin overrides): templates/ at the top of
        # the tree, reached through the package's link to it, which an installed package carries
        # as a directory of files (package-data in pyproject.toml).
        "DIRS": [Path(__file__).resolve().parent / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


DATABASE_URL = env_str("DATABASE_URL", url=True)
DATABASE_CONN_MAX_AGE = env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0, unit="seconds")
DATABASE_PREPARE = env_bool("DATABASE_PREPARE", True)
DATABASE_POOL_SIZE = env_int("DATABASE_POOL_SIZE", 20, minimum=0, unit="connections")
DATABASE_URL_FORMS = "postgres://USER:PASSWORD@HOST:5432/NAME or sqlite:////absolute/path/telemachus.sqlite3"


def database_url_parse(url: str) -> dict:
    """DATABASE_URL as Django's database settings, or ImproperlyConfigured naming what is wrong
    (the URL shown without its password). Only PostgreSQL and a SQLite file: the code runs on
    those two (an in-memory SQLite would be a different empty database in each process)."""
    shown = url_without_password(url)
    try:
        config = dj_database_url.parse(url, conn_max_age=DATABASE_CONN_MAX_AGE)
    except ValueError as exc:  # dj_database_url's ParseError and UnknownSchemeError
        reason = "unknown scheme" if isinstance(exc, dj_database_url.UnknownSchemeError) else "not a valid URL"
        raise ImproperlyConfigured(
            f"DATABASE_URL is not a database URL ({reason}: {shown}): it must be {DATABASE_URL_FORMS}"
        ) from None
    if config["ENGINE"] not in ("django.db.backends.postgresql", "django.db.backends.sqlite3"):
        raise ImproperlyConfigured(
            f"DATABASE_URL names a {config['ENGINE'].rsplit('.', 1)[-1]} database ({shown}): Telemachus runs on "
            f"PostgreSQL or SQLite, {DATABASE_URL_FORMS}"
        )
    if not config["NAME"]:
        raise ImproperlyConfigured(f"DATABASE_URL names no database ({shown}): it must be {DATABASE_URL_FORMS}")
    if config["NAME"] == ":memory:":
        raise ImproperlyConfigured(
            f"DATABASE_URL names an in-memory SQLite database ({shown}), which each process would have "
            "to itself: name a file, sqlite:////absolute/path/telemachus.sqlite3"
        )
    return config  # type: ignore[return-value]


def database_config(url: str) -> dict:
    """SQLite runs every transaction as BEGIN IMMEDIATE so a read-then-write transaction (the claim)
    takes the write lock up front instead of failing with 'database is locked' on upgrade; WAL lets
    the API read while a worker writes.

    Without DATABASE_URL: the SQLite file under var/, for `make run`; but not when a variable that
    looks like a misspelling of it is set (DATABSE_URL, DATABASE_URI: the deployer meant a
    database, and would otherwise be served an empty one without a word), nor with DEBUG off
    (production on a file inside the code's checkout, by accident, is found only when a second
    host cannot see its jobs; SQLite on purpose is one explicit `sqlite:///` URL away)."""
    if not url:
        misspelled = environment_misspellings("DATABASE_URL")
        if misspelled:
            raise ImproperlyConfigured(
                f"{misspelled[0]} is set but DATABASE_URL is not: a misspelling? Rename it DATABASE_URL "
                f"(without DATABASE_URL this would run on the SQLite file {VAR_DIR / 'telemachus.sqlite3'})"
            )
        if not DEBUG:
            raise ImproperlyConfigured(
                "DATABASE_URL is not set and DEBUG is off: production would run on the embedded SQLite file "
                f"{VAR_DIR / 'telemachus.sqlite3'}; set DATABASE_URL to {DATABASE_URL_FORMS} (SQLite on purpose: "
                "one host only)"
            )
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{VAR_DIR / 'telemachus.sqlite3'}"
    config = database_url_parse(url)
    if config["ENGINE"] == "django.db.backends.sqlite3":
        config["OPTIONS"] = {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    elif config["ENGINE"] == "django.db.backends.postgresql":
        config["CONN_HEALTH_CHECKS"] = True
        # Parameters bound on the server, and a statement run 5 times on a connection prepared
        # there (psycopg's default threshold; Django's is never): every claim, finish and submit
        # runs the same few statements, and parsing and planning them each time was a sixth of
        # PostgreSQL's CPU per /v1/ call (bench/gateway.py, 7.3-8.0 ms against 6.0-6.1 prepared).
        # Behind PgBouncer neither (below). DATABASE_PREPARE=0 turns both off.
        if DATABASE_PREPARE:
            config["OPTIONS"] = {**config.get("OPTIONS", {}), "server_side_binding": True, "prepare_threshold": 5}
        # Under ASGI each request runs in a thread of its own, so thread-local persistent
        # connections do not outlive it: a pool lets requests reuse connections instead of opening
        # one each (workers keep two connections of their own and leave the pool out).
        if DATABASE_POOL_SIZE and not config["CONN_MAX_AGE"]:
            pool = {"min_size": 1, "max_size": DATABASE_POOL_SIZE, "timeout": 30}
            config["OPTIONS"] = {**config.get("OPTIONS", {}), "pool": pool}
    return config


DATABASES = {"default": database_config(DATABASE_URL)}

# DATABASE_URL names PgBouncer in transaction pooling (TELEMACHUS_PGBOUNCER=1; bin/pgbouncer-test
# starts one, and .ci/run runs the concurrency tests through it). Each transaction may then run on
# another server connection, so nothing may outlive a transaction on the server:
# * server-side cursors (QuerySet.iterator() on PostgreSQL) DECLARE a cursor that a FETCH in a
#   later transaction would look for on another connection: off;
# * prepared statements: psycopg 3 prepares a query it has run 5 times on a connection
#   (prepare_threshold); PgBouncer keeps track of them only from 1.21 (max_prepared_statements)
#   and Debian 12 ships 1.18, so never prepare (off here, as in Django's default; on without a
#   pooler, above), and bind parameters in the client as Django does by default;
# * session state: SET (not SET LOCAL), advisory locks, temporary tables, LISTEN. The code takes
#   none but LISTEN (its SET is `SET TRANSACTION ...` inside a transaction; its locks are row locks;
#   NOTIFY is sent inside transactions or in autocommit, which a pooler passes on; Django's SET TIME
#   ZONE is a parameter PgBouncer tracks per client). A LISTEN through the pooler registers on
#   whichever server connection ran it, and the notifications never reach the listener: listeners
#   connect directly, to TELEMACHUS_LISTEN_DATABASE_URL;
# * settings sent at connect (`options=-c ...`): PgBouncer refuses them, or drops them when told
#   to ignore them. The worker's idle_in_transaction_session_timeout is not sent (scheduler/worker/
#   runner.py); PgBouncer's idle_transaction_timeout takes its place.
TELEMACHUS_PGBOUNCER = env_bool("TELEMACHUS_PGBOUNCER", False)
if TELEMACHUS_PGBOUNCER and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    options = {k: v for k, v in DATABASES["default"].get("OPTIONS", {}).items() if k != "server_side_binding"}
    DATABASES["default"]["OPTIONS"] = {**options, "prepare_threshold": None}
# PostgreSQL: where the LISTEN connection goes (one per process: scheduler/notify/listener.py).
# LISTEN needs a server session of its own, which a transaction-pooling PgBouncer does not keep:
# behind one, point this at PostgreSQL itself. Empty: DATABASE_URL.
TELEMACHUS_LISTEN_DATABASE_URL = env_str("TELEMACHUS_LISTEN_DATABASE_URL", url=True)
if TELEMACHUS_LISTEN_DATABASE_URL:
    try:
        listen_engine = dj_database_url.parse(TELEMACHUS_LISTEN_DATABASE_URL)["ENGINE"]
    except ValueError:
        listen_engine = ""
    if listen_engine != "django.db.backends.postgresql":
        raise ImproperlyConfigured(
            "TELEMACHUS_LISTEN_DATABASE_URL must be postgres://USER:PASSWORD@HOST:5432/NAME (PostgreSQL itself, "
            f"not a pooler), got {url_without_password(TELEMACHUS_LISTEN_DATABASE_URL)!r}: fix it, or unset it"
        )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL", url=True)
if REDIS_URL and not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
    raise ImproperlyConfigured(
        f"REDIS_URL must be redis://[:PASSWORD@]HOST:6379/DB, rediss://... (TLS) or unix:///path, got "
        f"{url_without_password(REDIS_URL)!r}: fix it, or unset it (in-memory channel layer, per-process cache)"
    )
# Deployments (or test runs) that share one Redis keep apart by this prefix: the channel layer's
# channels and groups, and the cache's keys (throttles, sign-in and bad-credential counts) alike.
REDIS_PREFIX = env_str("REDIS_PREFIX", "telemachus")
# The channel layer receives with a blocking read that Redis answers after 5 s when nothing came
# (RedisChannelLayer.brpop_timeout). redis-py's own socket timeout defaults to 5 s too (redis-py
# 6+), so an idle receive raced it and lost: every idle dashboard socket closed with 1011 within a
# minute and the job feed logged a timeout every few seconds. The socket timeout must exceed the
# blocking read; a dead server is still noticed, by the health check before a command on a
# connection idle that long and by TCP keepalive.
CHANNEL_LAYER_BLOCKING_READ_SECONDS = 5
REDIS_SOCKET_TIMEOUT = env_float("REDIS_SOCKET_TIMEOUT", 30, unit="seconds")
if REDIS_SOCKET_TIMEOUT <= CHANNEL_LAYER_BLOCKING_READ_SECONDS:
    raise ImproperlyConfigured(
        f"REDIS_SOCKET_TIMEOUT must exceed the channel layer's {CHANNEL_LAYER_BLOCKING_READ_SECONDS} s blocking "
        f"read, got {REDIS_SOCKET_TIMEOUT:g}: set it higher, or unset it for the default (30)"
    )
REDIS_CHANNEL_CAPACITY = env_int("REDIS_CHANNEL_CAPACITY", 10_000, minimum=1, unit="messages")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [
                    {
                        "address": REDIS_URL,
                        "socket_timeout": REDIS_SOCKET_TIMEOUT,
                        "socket_connect_timeout": 5,
                        "socket_keepalive": True,
                        "health_check_interval": REDIS_SOCKET_TIMEOUT,
                    }
                ],
                "prefix": REDIS_PREFIX,
                # One channel per API process receives the output of every stream it relays.
                "capacity": REDIS_CHANNEL_CAPACITY,
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Throttle and sign-in counts (telemachus/http/throttles.py, telemachus/teams/signin.py): per process by
# default, shared by every API server through Redis when REDIS_URL is set, under REDIS_PREFIX (keys
# `<prefix>:1:<key>`), so two deployments on one Redis never share a lockout or a throttle.
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": REDIS_PREFIX,
        }
    }
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
GUARDIAN_RAISE_403 = False
# Anonymous users get no object permissions, so guardian needs no AnonymousUser row.
ANONYMOUS_USER_NAME = None

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# The dashboard's sign-in (team members are not admin staff, so not the admin's login page).
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"
STATIC_ROOT = VAR_DIR / "static"
# WhiteNoise serves admin and dashboard assets from daphne itself, so no separate web server is
# needed. In DEBUG it reads them straight from the apps; in production run collectstatic.
WHITENOISE_USE_FINDERS = DEBUG
if DEBUG:
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every request without it.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"
        if DEBUG
        else "whitenoise.storage.CompressedManifestStaticFilesStorage"
    },
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Apps' API keys and people's tokens, stored as digests (telemachus/keys/).
        "telemachus.keys.authentication.CredentialAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAuthenticated",
        "telemachus.keys.authentication.ApiKeysWhereAllowed",
    ],
    "DEFAULT_PARSER_CLASSES": ["telemachus.http.parsers.BoundedJSONParser"],
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "rest_framework.renderers.BrowsableAPIRenderer",
    ],
    "DEFAULT_PAGINATION_CLASS": "telemachus.http.pagination.NewestFirstCursorPagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "telemachus.http.exception_handler.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Telemachus API",
    "DESCRIPTION": "Admit, queue and place AI workloads onto executors under four-scope concurrency caps.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Serve Swagger UI from the installed sidecar package, not a CDN: works offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "ENUM_NAME_OVERRIDES": {"PermissionEnum": "telemachus.teams.api.PERMISSION_CHOICES"},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        # Paths served ahead of Django's URLconf: /v1/, /api/jobs/{id}/wait/ and /stream/.
        "scheduler.gateway.schema.gateway_paths",
        "telemachus.http.schema.declare_errors",
    ],
}

# Deployment hardening: on with DEBUG off, so `manage.py check --deploy` is clean in production.
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31_536_000, minimum=0, unit="seconds")
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
# Only behind a TLS-terminating proxy that sets X-Forwarded-Proto is that header trusted (else any
# client could claim https); the server itself speaks plain HTTP (telemachus/serve.py).
BEHIND_TLS_PROXY = env_bool("BEHIND_TLS_PROXY", False)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if BEHIND_TLS_PROXY else None
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
# Content-Security-Policy (django-csp): scripts only from this site or inline with the request's
# nonce (`<script nonce="{{ request.csp_nonce }}">`), no plugins, no framing, forms and sockets to
# this site only. Inline styles stay allowed: the admin's templates use style attributes.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF, NONCE],
        "style-src": [SELF, "'unsafe-inline'"],
        "img-src": [SELF, "data:"],
        "font-src": [SELF, "data:"],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    },
}

LOG_LEVEL = env_choice("LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "filters": {"without_traceback": {"()": "telemachus.http.suspicious.WithoutTraceback"}},
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
        # A request Django refuses as suspicious (a Host not in ALLOWED_HOSTS, above all) is the
        # client's doing: one line, never the traceback Django attaches (telemachus/http/suspicious.py).
        "security": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["without_traceback"]},
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    # httpx logs every request at INFO: one line per model call is the worker's job, not httpx's.
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        "django.security": {"handlers": ["security"], "propagate": False},
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}

# --- Telemachus knobs -------------------------------------------------------------------------
# Slot lease: a worker that stops heartbeating loses its jobs this many seconds later.
TELEMACHUS_LEASE_SECONDS = env_int("TELEMACHUS_LEASE_SECONDS", 30, minimum=1, unit="seconds")
# Retryable dispatch failures (connect errors, timeouts, 429, 502/503/504) wait an exponential,
# jittered backoff (base * 2^(attempt-1), capped) before the next attempt, up to max_attempts.
TELEMACHUS_RETRY_BASE_SECONDS = env_float("TELEMACHUS_RETRY_BASE_SECONDS", 1)
TELEMACHUS_RETRY_MAX_SECONDS = env_float("TELEMACHUS_RETRY_MAX_SECONDS", 60)
# Circuit breaker: open after this many consecutive executor faults, keep it out of placement for
# the cooldown, then let one trial request decide.
TELEMACHUS_BREAKER_THRESHOLD = env_int("TELEMACHUS_BREAKER_THRESHOLD", 5)
TELEMACHUS_BREAKER_COOLDOWN_SECONDS = env_float("TELEMACHUS_BREAKER_COOLDOWN_SECONDS", 30)
# PostgreSQL ends a worker's session idle this long inside a transaction (a worker frozen
# mid-claim would hold the claim lock, and so every claim, until it resumed); 0 turns it off.
TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS = env_float("TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS", 15)
# Active health probe of each executor (GET {endpoint}/models), by one worker per interval.
TELEMACHUS_PROBE_INTERVAL_SECONDS = env_float("TELEMACHUS_PROBE_INTERVAL_SECONDS", 15)
# Per-user rates (telemachus/http/throttles.py): "N/s", "N/min", "N/hour", "N/day"; empty turns one
# off. Job submissions (POST /api/jobs/, each job of POST /api/jobs/bulk/), /v1/ calls, and opens
# of /api/jobs/{id}/wait/ and /stream/.
TELEMACHUS_SUBMIT_RATE = env_rate("TELEMACHUS_SUBMIT_RATE", "100/s")
TELEMACHUS_OPENAI_RATE = env_rate("TELEMACHUS_OPENAI_RATE", "100/s")
TELEMACHUS_STREAM_RATE = env_rate("TELEMACHUS_STREAM_RATE", "100/s")
# Failed sign-ins (admin and dashboard) allowed per username from one client address, and per
# client address, within the window (from the first failure); past either, the form answers 429 to
# that address until the window ends (telemachus/teams/signin.py). A username's failures from
# anywhere never refuse (anyone could lock its owner out): past SLOWDOWN_AFTER of them each attempt
# on it waits, from SLOWDOWN_SECONDS doubling up to SLOWDOWN_MAX_SECONDS.
TELEMACHUS_LOGIN_FAILURES_PER_USERNAME = env_int("TELEMACHUS_LOGIN_FAILURES_PER_USERNAME", 5)
TELEMACHUS_LOGIN_FAILURES_PER_ADDRESS = env_int("TELEMACHUS_LOGIN_FAILURES_PER_ADDRESS", 20)
TELEMACHUS_LOGIN_WINDOW_SECONDS = env_int("TELEMACHUS_LOGIN_WINDOW_SECONDS", 900)
TELEMACHUS_LOGIN_SLOWDOWN_AFTER = env_int("TELEMACHUS_LOGIN_SLOWDOWN_AFTER", 5)
TELEMACHUS_LOGIN_SLOWDOWN_SECONDS = env_float("TELEMACHUS_LOGIN_SLOWDOWN_SECONDS", 0.5)
TELEMACHUS_LOGIN_SLOWDOWN_MAX_SECONDS = env_float("TELEMACHUS_LOGIN_SLOWDOWN_MAX_SECONDS", 4)
# Requests with a key or token that matches nothing, allowed per client address within the window
# (from the first failure); past it, 429 with Retry-After until the window ends (telemachus/keys/).
TELEMACHUS_AUTH_FAILURES_PER_ADDRESS = env_int("TELEMACHUS_AUTH_FAILURES_PER_ADDRESS", 20)
TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS = env_int("TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS", 60)
# The currency of executors' prices, jobs' `cost`, `ai.cost` budgets and /api/spend/ (one for all).
TELEMACHUS_CURRENCY = env_str("TELEMACHUS_CURRENCY", "USD")
# The live dashboard re-reads when the database changes; between changes it sends a heartbeat this
# often, so the page's "updated" stamp stays honest.
TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = env_float("TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS", 5)
# The dashboard's charts: the workers record one row per bucket (seconds) per team, executor and
# the whole queue, and delete rows older than the retention (scheduler/services/history.py).
TELEMACHUS_HISTORY_BUCKET_SECONDS = max(env_int("TELEMACHUS_HISTORY_BUCKET_SECONDS", 60), 1)
TELEMACHUS_HISTORY_RETENTION_HOURS = max(env_float("TELEMACHUS_HISTORY_RETENTION_HOURS", 24), 1)
# How often each worker reads the gauges (queued, running, slots in use) between bucket closes, so a
# bucket keeps the most it saw at once, not only its state as it closed.
TELEMACHUS_HISTORY_SAMPLE_SECONDS = max(env_float("TELEMACHUS_HISTORY_SAMPLE_SECONDS", 2), 0.1)
# Retention (docs/retention.md): a finished job (done, failed, canceled), its events and what else
# is only its own are deleted this many hours after it ended, unless its team sets its own
# (`retention_hours`); the workers prune every PRUNE_INTERVAL seconds, PRUNE_BATCH rows per
# transaction. The audit log keeps its own, longer retention.
TELEMACHUS_RETENTION_HOURS = env_float("TELEMACHUS_RETENTION_HOURS", 720, minimum=0, unit="hours")
TELEMACHUS_AUDIT_RETENTION_DAYS = env_float("TELEMACHUS_AUDIT_RETENTION_DAYS", 365, minimum=0, unit="days")
TELEMACHUS_PRUNE_INTERVAL_SECONDS = env_float("TELEMACHUS_PRUNE_INTERVAL_SECONDS", 30, minimum=1, unit="seconds")
TELEMACHUS_PRUNE_BATCH = env_int("TELEMACHUS_PRUNE_BATCH", 2000, minimum=1, unit="rows")
# A worker rests this many times as long as each full batch took before the next (3: a quarter of
# the time), so a backlog does not take the database's CPU from the queue (bench/RESULTS.md).
TELEMACHUS_PRUNE_PACE = env_float("TELEMACHUS_PRUNE_PACE", 3, minimum=0)
# Largest request body the API accepts (bytes); larger bodies get 413 payload_too_large.
TELEMACHUS_MAX_BODY_BYTES = env_int("TELEMACHUS_MAX_BODY_BYTES", 1_048_576, minimum=1, unit="bytes")
# The OpenAI-compatible endpoint: a call that has no answer after this long gets 504 and its job
# is canceled; database threads per API process shared by its waiting requests (scheduler/gateway/).
TELEMACHUS_GATEWAY_TIMEOUT_SECONDS = env_float("TELEMACHUS_GATEWAY_TIMEOUT_SECONDS", 600, minimum=0, unit="seconds")
TELEMACHUS_GATEWAY_DB_THREADS = env_int("TELEMACHUS_GATEWAY_DB_THREADS", 8, minimum=1, unit="threads")
# One hop: an API process claims the /v1/ call it holds right after its submit (the same claim as
# a worker's) and runs it itself when it can run now (scheduler/gateway/onehop.py, docs/gateway.md).
TELEMACHUS_GATEWAY_ONE_HOP = env_bool("TELEMACHUS_GATEWAY_ONE_HOP", True)
# The Batch API (scheduler/batches/, docs/batches.md): an input file's largest size and most lines;
# the most lines of one batch queued or running at once (the workers feed more as they end), and
# how often an idle worker looks at the batches under way.
TELEMACHUS_BATCH_FILE_MAX_BYTES = env_int("TELEMACHUS_BATCH_FILE_MAX_BYTES", 200 * 1024 * 1024, minimum=1, unit="bytes")
TELEMACHUS_BATCH_MAX_LINES = env_int("TELEMACHUS_BATCH_MAX_LINES", 50_000, minimum=1, unit="lines")
TELEMACHUS_BATCH_WINDOW = min(env_int("TELEMACHUS_BATCH_WINDOW", 1000, minimum=1, unit="lines"), 1000)
TELEMACHUS_BATCH_FEED_SECONDS = env_float("TELEMACHUS_BATCH_FEED_SECONDS", 0.5, minimum=0.01, unit="seconds")
# A job submitted without `requirements.est_tokens` is estimated (scheduler/core/estimates.py):
# its prompt's tokens plus its `max_tokens`, or, without max_tokens, the completion its model is
# expected to write: per model (`model=N,...`), else the default. Budgets reserve the estimate.
TELEMACHUS_COMPLETION_ESTIMATE = env_int("TELEMACHUS_COMPLETION_ESTIMATE", 256)
TELEMACHUS_COMPLETION_ESTIMATES = env_counts("TELEMACHUS_COMPLETION_ESTIMATES")
# Dotted path of a custom QueuePolicy class; empty means the record's choice or the default.
TELEMACHUS_QUEUE_POLICY = env_str("TELEMACHUS_QUEUE_POLICY")
# Extra executor drivers, `kind=dotted.path.Class` comma-separated, added to the built-in registry.
TELEMACHUS_EXECUTOR_DRIVERS = env_list("TELEMACHUS_EXECUTOR_DRIVERS", [])
# Extra task callables for cpu-node executors, `name=dotted.path.function` comma-separated.
TELEMACHUS_TASKS = env_list("TELEMACHUS_TASKS", [])

# Django's tasks API: `my_task.enqueue(...)` submits a governed `task` job that runs on a cpu-node
# executor (scheduler/tasks_backend.py, docs/tasks.md). The team and the service user a task is
# submitted as, unless the caller names them with `enqueue_as(...)`.
TASKS = {
    "default": {
        "BACKEND": "scheduler.tasks_backend.TelemachusBackend",
        "OPTIONS": {
            "team": env_str("TELEMACHUS_TASK_TEAM"),
            "user": env_str("TELEMACHUS_TASK_USER"),
        },
    },
}
# host:port where a worker serves /metrics (no token), /healthz and /readyz; unset: none.
TELEMACHUS_METRICS_BIND = env_str("TELEMACHUS_METRICS_BIND")
# Extra tools for flows and tool jobs, `name=dotted.path.tool` comma-separated (executors/tools.py).
TELEMACHUS_TOOLS = env_list("TELEMACHUS_TOOLS", [])
# Threads per worker that run tools (a flow's tool calls between rounds, tool jobs).
TELEMACHUS_TOOL_THREADS = env_int("TELEMACHUS_TOOL_THREADS", 8, minimum=1, unit="threads")
# A flow's round whose tools are all done this soon after the model's answer is ended and requeued
# in one transaction, the slot held that long at most (scheduler/flows/runner.py); 0: never.
TELEMACHUS_FLOW_QUICK_TOOLS_MS = env_int("TELEMACHUS_FLOW_QUICK_TOOLS_MS", 50)
# Prefix-cache-aware placement (QueuePolicy.placement = prefix, scheduler/core/prefix.py): a
# prompt's block, in characters; the most blocks hashed per prompt; the prefix hashes a process
# remembers per executor; the load bound, as a multiple of the least busy executor's recent work.
TELEMACHUS_PREFIX_BLOCK_CHARS = env_int("TELEMACHUS_PREFIX_BLOCK_CHARS", 256, minimum=16, unit="characters")
TELEMACHUS_PREFIX_MAX_BLOCKS = env_int("TELEMACHUS_PREFIX_MAX_BLOCKS", 64, minimum=1, unit="blocks")
TELEMACHUS_PREFIX_RECORD_SIZE = env_int("TELEMACHUS_PREFIX_RECORD_SIZE", 20_000, minimum=1, unit="hashes")
TELEMACHUS_PREFIX_LOAD_FACTOR = env_float("TELEMACHUS_PREFIX_LOAD_FACTOR", 1.4)
# Failed authentications with one credential prefix (a key's or token's marker and first random
# characters), from any address, within TELEMACHUS_AUTH_FAILURE_WINDOW_SECONDS; past it, and past
# TELEMACHUS_AUTH_FAILURES_PER_ADDRESS, further *failed* attempts get 429 instead of 401. A right
# credential always authenticates (telemachus/keys/failures.py).
TELEMACHUS_AUTH_FAILURES_PER_CREDENTIAL = env_int("TELEMACHUS_AUTH_FAILURES_PER_CREDENTIAL", 10)
# Fernet keys, comma-separated, that seal executors' secrets at rest (executors/sealing.py): the
# first seals, all unseal; unset, a key derived from SECRET_KEY seals. Rotate: new key first, run
# `manage.py executor_secrets_rotate`, then drop the old one.
TELEMACHUS_SECRETS_KEY = env_str("TELEMACHUS_SECRETS_KEY", secret=True)

# Webhooks (telemachus/webhooks/, docs/webhooks.md): a team's receivers of budget, executor and job
# events, signed per the Standard Webhooks specification and delivered from an outbox by the workers.
# A receiver's URL must resolve to public addresses only (checked when it is registered and again
# before each attempt, so a name that comes to point inside the network is refused): 1 allows
# private, loopback and link-local ones, for a receiver on the operator's own network, and tests.
TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE = env_bool("TELEMACHUS_WEBHOOKS_ALLOW_PRIVATE", False)
# One attempt's bound (connect, send, the answer's status and first bytes), in seconds.
TELEMACHUS_WEBHOOKS_TIMEOUT_SECONDS = env_float("TELEMACHUS_WEBHOOKS_TIMEOUT_SECONDS", 5)
# A failed attempt is retried after an exponential, jittered backoff (base * 2^(attempt-1), capped),
# until MAX_ATTEMPTS attempts or MAX_AGE_SECONDS after the event; then the delivery is `failed`.
TELEMACHUS_WEBHOOKS_RETRY_BASE_SECONDS = env_float("TELEMACHUS_WEBHOOKS_RETRY_BASE_SECONDS", 10)
TELEMACHUS_WEBHOOKS_RETRY_MAX_SECONDS = env_float("TELEMACHUS_WEBHOOKS_RETRY_MAX_SECONDS", 3600)
TELEMACHUS_WEBHOOKS_MAX_ATTEMPTS = env_int("TELEMACHUS_WEBHOOKS_MAX_ATTEMPTS", 8)
TELEMACHUS_WEBHOOKS_MAX_AGE_SECONDS = env_float("TELEMACHUS_WEBHOOKS_MAX_AGE_SECONDS", 86_400)
# How often an idle worker looks for due deliveries.
TELEMACHUS_WEBHOOKS_POLL_SECONDS = env_float("TELEMACHUS_WEBHOOKS_POLL_SECONDS", 1)

# Traces (telemachus/tracing.py, docs/tracing.md) are configured by OpenTelemetry's own OTEL_*
# variables, read by its SDK. 1: model-call spans also carry the prompts and the answers
# (gen_ai.input.messages, gen_ai.output.messages); never by default.
TELEMACHUS_TRACE_CONTENT = env_bool("TELEMACHUS_TRACE_CONTENT", False)


def env_group_roles(name: str) -> dict[str, list[tuple[str, str]]]:
    """`group=team:role,...` as {group: [(team slug, role), ...]} (a group may give several)."""
    mapping: dict[str, list[tuple[str, str]]] = {}
    for entry in env_list(name, []):
        group, sep, target = entry.rpartition("=")
        team, colon, role = target.partition(":")
        if not sep or not group.strip() or not colon or not re.fullmatch(r"[-a-zA-Z0-9_]+", team.strip()):
            raise ImproperlyConfigured(f"{name} entries must be group=team:role, got {entry!r}")
        if role.strip() not in ("member", "manager"):
            raise ImproperlyConfigured(f"{name}: the role of {entry!r} must be member or manager")
        mapping.setdefault(group.strip(), []).append((team.strip(), role.strip()))
    return mapping


# Sign-in through OpenID Connect for the dashboard and the admin (telemachus/teams/oidc.py,
# docs/signin.md), off unless an issuer is set: then the sign-in pages offer it beside the password
# form, which stays for a break-glass admin. The issuer must be exactly the `issuer` its discovery
# document (ISSUER/.well-known/openid-configuration) and its ID tokens name.
TELEMACHUS_OIDC_ISSUER = env_str("TELEMACHUS_OIDC_ISSUER", url=True)
# The button's words: "Sign in with <name>".
TELEMACHUS_OIDC_NAME = env_str("TELEMACHUS_OIDC_NAME", "single sign-on")
# The claim (of the ID token or the userinfo answer) that lists the user's groups, and what they
# give: teams' roles (`group=team:role`, comma-separated: `eng=demo:member,eng-leads=demo:manager`),
# the operator's role (scheduler.manage and the admin's door) and the admin's (superuser). Set on
# every sign-in: added and removed, audited (source `sso`). Memberships of teams the mapping does
# not name are left to their managers; with neither group list set, operator flags are left alone.
TELEMACHUS_OIDC_GROUPS_CLAIM = env_str("TELEMACHUS_OIDC_GROUPS_CLAIM", "groups")
TELEMACHUS_OIDC_TEAM_GROUPS = env_group_roles("TELEMACHUS_OIDC_TEAM_GROUPS")
TELEMACHUS_OIDC_OPERATOR_GROUPS = env_list("TELEMACHUS_OIDC_OPERATOR_GROUPS", [])
TELEMACHUS_OIDC_ADMIN_GROUPS = env_list("TELEMACHUS_OIDC_ADMIN_GROUPS", [])
if TELEMACHUS_OIDC_ISSUER:
    # mozilla-django-oidc's settings; its endpoints come from the issuer's discovery document.
    OIDC_RP_CLIENT_ID = env_str("TELEMACHUS_OIDC_CLIENT_ID")
    OIDC_RP_CLIENT_SECRET = env_str("TELEMACHUS_OIDC_CLIENT_SECRET", secret=True)
    if not OIDC_RP_CLIENT_ID or not OIDC_RP_CLIENT_SECRET:
        raise ImproperlyConfigured("TELEMACHUS_OIDC_ISSUER needs TELEMACHUS_OIDC_CLIENT_ID and _CLIENT_SECRET")
    OIDC_RP_SIGN_ALGO = env_str("TELEMACHUS_OIDC_SIGN_ALGO", "RS256")
    OIDC_RP_SCOPES = env_str("TELEMACHUS_OIDC_SCOPES", "openid email profile")
    OIDC_USE_PKCE = True
    OIDC_TIMEOUT = env_float("TELEMACHUS_OIDC_TIMEOUT_SECONDS", 10)
    LOGIN_REDIRECT_URL_FAILURE = "/login/?sso=failed"
    AUTHENTICATION_BACKENDS = [*AUTHENTICATION_BACKENDS, "telemachus.teams.oidc.OidcBackend"]

# --- Serving -----------------------------------------------------------------------------------
# The ASGI server telemachus/serve.py (and so bin/run) starts, and how long it lets requests in
# flight finish on SIGTERM before closing what is left (a stream, a dashboard socket).
TELEMACHUS_SERVER = env_choice("TELEMACHUS_SERVER", "uvicorn", ("uvicorn", "daphne"))
TELEMACHUS_SERVER_GRACE = env_int("TELEMACHUS_SERVER_GRACE", 5, minimum=0, unit="seconds")
# Seconds a client has to send a request's headers (from connecting, or from the first byte of the
# next request on a kept-alive connection) before uvicorn closes the connection: a client trickling
# a header line every few seconds (slowloris) would otherwise hold the connection for good
# (telemachus/http/protocol.py). 0: no bound. daphne has no such bound: there nginx's
# client_header_timeout is the only one.
TELEMACHUS_HEADER_TIMEOUT_SECONDS = env_float("TELEMACHUS_HEADER_TIMEOUT_SECONDS", 10, minimum=0, unit="seconds")
# /api/schema/ and /api/docs/ without signing in: on by default with DEBUG (a development run),
# off in production, where they answer 401 to anyone without a session, token or key (the schema
# maps every endpoint and parameter: a reconnaissance aid that the public has no need of).
TELEMACHUS_PUBLIC_SCHEMA = env_bool("TELEMACHUS_PUBLIC_SCHEMA", DEBUG)
# The highest priority a principal may ask for when the queue policy's priority_map says nothing of
# them (operators are never limited): members and keys cannot jump every other team's work at 100
# unless an operator says so (priority_map {"member": 100}). Above it a job is clamped, with an event,
# or refused, per the policy's priority_over_limit.
TELEMACHUS_PRIORITY_CEILING = max(min(env_int("TELEMACHUS_PRIORITY_CEILING", 10, minimum=-100), 100), -100)
# Read by others, recorded here so `manage.py telemachus_check` shows them and a misspelling of one
# is caught: prometheus_client's multiprocess directory, and bin/run's grace for the worker.
env_note("PROMETHEUS_MULTIPROC_DIR")
env_note("TELEMACHUS_SHUTDOWN_GRACE", "30")

# Every variable read above, as `manage.py telemachus_check` prints it (secrets as "(secret set)",
# URLs without their password), and variables that look like misspellings of those left unset.
ENVIRONMENT_READ = environment_read()
ENVIRONMENT_MISSPELLED = environment_misspelled()
