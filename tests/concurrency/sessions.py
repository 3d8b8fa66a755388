"""A PostgreSQL session of the test's own, straight to the server.

Behind PgBouncer in transaction pooling (TELEMACHUS_PGBOUNCER=1) Django's connection is a client
of the pooler: each of its statements runs on whichever server connection is free, which may be
one that last served a worker and still carries the worker's application_name. A test that
terminates sessions (pg_terminate_backend) through that connection can kill the very session it
runs on. Such a test acts from this one instead: PostgreSQL itself, at the host and port of
TELEMACHUS_LISTEN_DATABASE_URL (where the workers' LISTEN connections go), in the test database.
Without a pooler it is simply another session on Django's database."""

from urllib.parse import urlsplit

import psycopg
from django.conf import settings
from django.db import connection


def postgres_session() -> psycopg.Connection:
    """An autocommit psycopg connection to the test database on PostgreSQL itself; close it."""
    params = {
        k: v
        for k, v in connection.get_connection_params().items()
        if k not in {"cursor_factory", "context", "prepare_threshold"}
    }
    if settings.TELEMACHUS_PGBOUNCER:
        direct = urlsplit(settings.TELEMACHUS_LISTEN_DATABASE_URL)
        params.update(host=direct.hostname or "127.0.0.1", port=direct.port or 5432)
    return psycopg.connect(**params, autocommit=True)
