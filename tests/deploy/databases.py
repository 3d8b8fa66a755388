"""Databases of a test's own beside the test database, on the same PostgreSQL server (a restore's
target, an upgrade's database): named after the test database, so two runs with their own test
databases never share one, and dropped afterwards."""

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from django.db import connection


def server_args() -> list[str]:
    """The test database's server, as pg_dump, pg_restore and psql take it."""
    s = connection.settings_dict
    return ["-h", s["HOST"] or "127.0.0.1", "-p", str(s["PORT"] or 5432), "-U", s["USER"] or "postgres"]


def server_connect(dbname: str) -> psycopg.Connection:
    s = connection.settings_dict
    return psycopg.connect(
        host=s["HOST"] or "127.0.0.1",
        port=s["PORT"] or 5432,
        user=s["USER"] or "postgres",
        password=s["PASSWORD"] or None,
        dbname=dbname,
        autocommit=True,
    )


def database_url(dbname: str) -> str:
    """DATABASE_URL for `dbname` on the test database's server."""
    s = connection.settings_dict
    password = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    return f"postgres://{s['USER'] or 'postgres'}{password}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{dbname}"


@contextmanager
def scratch_database(suffix: str, *, create: bool = True) -> Iterator[str]:
    """The name of a database `<test database>_<suffix>`, new (created unless `create` is false)
    and dropped on the way out, its sessions ended."""
    name = f"{connection.settings_dict['NAME']}_{suffix}"
    with server_connect("postgres") as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if create:
            admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with server_connect("postgres") as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
