"""Settings, all from the environment (12-factor).

Every knob has a safe default for `make run` on one machine (SQLite under var/, in-memory channel
layer); production sets DATABASE_URL, REDIS_URL, SECRET_KEY, DEBUG=0 and ALLOWED_HOSTS.
"""

import os
import re
from pathlib import Path

import dj_database_url
import django
from csp.constants import NONCE, NONE, SELF
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TELEMACHUS_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in {"1", "true", "yes", "on"}:
        return True
    if raw.lower() in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None


def env_counts(name: str) -> dict[str, int]:
    """`key=N,key=N` as a mapping to positive integers."""
    counts = {}
    for entry in env_list(name, []):
        key, sep, raw = entry.rpartition("=")
        if not sep or not key.strip() or not raw.strip().isdigit() or int(raw) < 1:
            raise ImproperlyConfigured(f"{name} entries must be name=N with N a positive integer, got {entry!r}")
        counts[key.strip()] = int(raw)
    return counts


def env_rate(name: str, default: str) -> str:
    """A request rate, "N/s", "N/min", "N/hour" or "N/day" (empty: off)."""
    raw = os.environ.get(name, default).strip()
    if raw and not re.fullmatch(r"[1-9][0-9]*/(s|sec|second|m|min|minute|h|hour|d|day)", raw):
        raise ImproperlyConfigured(f"{name} must be N/s, N/min, N/hour or N/day (or empty: off), got {raw!r}")
    return raw


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


DEBUG = env_bool("DEBUG", True)
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off")
    SECRET_KEY = "dev-insecure-telemachus-key-only-for-local-runs"
# Earlier SECRET_KEYs, comma-separated, while rotating: API keys and tokens (stored as digests keyed
# by it, telemachus/keys/digests.py), sessions and signatures made under them keep working.
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS", [])
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


def database_config(url: str | None) -> dict:
    """SQLite runs every transaction as BEGIN IMMEDIATE so a read-then-write transaction (the claim)
    takes the write lock up front instead of failing with 'database is locked' on upgrade; WAL lets
    the API read while a worker writes."""
    if not url:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{VAR_DIR / 'telemachus.sqlite3'}"
    config = dj_database_url.parse(url, conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 0))
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
        if env_bool("DATABASE_PREPARE", True):
            config["OPTIONS"] = {**config.get("OPTIONS", {}), "server_side_binding": True, "prepare_threshold": 5}
        # Under ASGI each request runs in a thread of its own, so thread-local persistent
        # connections do not outlive it: a pool lets requests reuse connections instead of opening
        # one each (workers keep two connections of their own and leave the pool out).
        pool = env_int("DATABASE_POOL_SIZE", 20)
        if pool and not config["CONN_MAX_AGE"]:
            config["OPTIONS"] = {**config.get("OPTIONS", {}), "pool": {"min_size": 1, "max_size": pool, "timeout": 30}}
    return config  # type: ignore[return-value]


DATABASES = {"default": database_config(os.environ.get("DATABASE_URL"))}

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
TELEMACHUS_LISTEN_DATABASE_URL = os.environ.get("TELEMACHUS_LISTEN_DATABASE_URL", "")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL", "")
# The channel layer receives with a blocking read that Redis answers after 5 s when nothing came
# (RedisChannelLayer.brpop_timeout). redis-py's own socket timeout defaults to 5 s too (redis-py
# 6+), so an idle receive raced it and lost: every idle dashboard socket closed with 1011 within a
# minute and the job feed logged a timeout every few seconds. The socket timeout must exceed the
# blocking read; a dead server is still noticed, by the health check before a command on a
# connection idle that long and by TCP keepalive.
REDIS_SOCKET_TIMEOUT = env_float("REDIS_SOCKET_TIMEOUT", 30)
CHANNEL_LAYER_BLOCKING_READ_SECONDS = 5
if REDIS_SOCKET_TIMEOUT <= CHANNEL_LAYER_BLOCKING_READ_SECONDS:
    raise ImproperlyConfigured(
        f"REDIS_SOCKET_TIMEOUT must exceed the channel layer's {CHANNEL_LAYER_BLOCKING_READ_SECONDS} s blocking read"
    )
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
                # Deployments (or test runs) that share one Redis keep apart by prefix.
                "prefix": os.environ.get("REDIS_PREFIX", "telemachus"),
                # One channel per API process receives the output of every stream it relays.
                "capacity": env_int("REDIS_CHANNEL_CAPACITY", 10_000),
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Throttle and sign-in counts (telemachus/http/throttles.py, telemachus/teams/signin.py): per process by
# default, shared by every API server through Redis when REDIS_URL is set.
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "telemachus",
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
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("BEHIND_TLS_PROXY", False) else None
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

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    # httpx logs every request at INFO: one line per model call is the worker's job, not httpx's.
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
    },
}

# --- Telemachus knobs -------------------------------------------------------------------------
# Slot lease: a worker that stops heartbeating loses its jobs this many seconds later.
TELEMACHUS_LEASE_SECONDS = env_int("TELEMACHUS_LEASE_SECONDS", 30)
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
TELEMACHUS_CURRENCY = os.environ.get("TELEMACHUS_CURRENCY", "USD")
# The live dashboard re-reads when the database changes; between changes it sends a heartbeat this
# often, so the page's "updated" stamp stays honest.
TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS = env_float("TELEMACHUS_DASHBOARD_HEARTBEAT_SECONDS", 5)
# The dashboard's charts: the workers record one row per bucket (seconds) per team, executor and
# the whole queue, and delete rows older than the retention (scheduler/services/history.py).
TELEMACHUS_HISTORY_BUCKET_SECONDS = max(env_int("TELEMACHUS_HISTORY_BUCKET_SECONDS", 60), 1)
TELEMACHUS_HISTORY_RETENTION_HOURS = max(env_float("TELEMACHUS_HISTORY_RETENTION_HOURS", 24), 1)
# Largest request body the API accepts (bytes); larger bodies get 413 payload_too_large.
TELEMACHUS_MAX_BODY_BYTES = env_int("TELEMACHUS_MAX_BODY_BYTES", 1_048_576)
# The OpenAI-compatible endpoint: a call that has no answer after this long gets 504 and its job
# is canceled; database threads per API process shared by its waiting requests (scheduler/gateway/).
TELEMACHUS_GATEWAY_TIMEOUT_SECONDS = env_float("TELEMACHUS_GATEWAY_TIMEOUT_SECONDS", 600)
TELEMACHUS_GATEWAY_DB_THREADS = env_int("TELEMACHUS_GATEWAY_DB_THREADS", 8)
# One hop: an API process claims the /v1/ call it holds right after its submit (the same claim as
# a worker's) and runs it itself when it can run now (scheduler/gateway/onehop.py, docs/gateway.md).
TELEMACHUS_GATEWAY_ONE_HOP = env_bool("TELEMACHUS_GATEWAY_ONE_HOP", True)
# A job submitted without `requirements.est_tokens` is estimated (scheduler/core/estimates.py):
# its prompt's tokens plus its `max_tokens`, or, without max_tokens, the completion its model is
# expected to write: per model (`model=N,...`), else the default. Budgets reserve the estimate.
TELEMACHUS_COMPLETION_ESTIMATE = env_int("TELEMACHUS_COMPLETION_ESTIMATE", 256)
TELEMACHUS_COMPLETION_ESTIMATES = env_counts("TELEMACHUS_COMPLETION_ESTIMATES")
# Dotted path of a custom QueuePolicy class; empty means the record's choice or the default.
TELEMACHUS_QUEUE_POLICY = os.environ.get("TELEMACHUS_QUEUE_POLICY", "")
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
            "team": os.environ.get("TELEMACHUS_TASK_TEAM", ""),
            "user": os.environ.get("TELEMACHUS_TASK_USER", ""),
        },
    },
}
# host:port where a worker serves /metrics (no token), /healthz and /readyz; unset: none.
TELEMACHUS_METRICS_BIND = os.environ.get("TELEMACHUS_METRICS_BIND", "")
# Extra tools for flows and tool jobs, `name=dotted.path.tool` comma-separated (executors/tools.py).
TELEMACHUS_TOOLS = env_list("TELEMACHUS_TOOLS", [])
# Threads per worker that run tools (a flow's tool calls between rounds, tool jobs).
TELEMACHUS_TOOL_THREADS = env_int("TELEMACHUS_TOOL_THREADS", 8)
# A flow's round whose tools are all done this soon after the model's answer is ended and requeued
# in one transaction, the slot held that long at most (scheduler/flows/runner.py); 0: never.
TELEMACHUS_FLOW_QUICK_TOOLS_MS = env_int("TELEMACHUS_FLOW_QUICK_TOOLS_MS", 50)
