"""`manage.py database_ensure`: make sure the database DATABASE_URL names exists, before
`migrate` (make run and make migrate call it first).

On PostgreSQL a database that does not exist is created, through the server's `postgres`
maintenance database, when DATABASE_URL's role may create databases. When it may not, or the
server cannot be reached, the command stops within seconds (connections time out after
CONNECT_TIMEOUT) and says what to run: the exact `createdb` command for the missing database. A
SQLite file is created by its first connection; only its directory is made here.

Then, on PostgreSQL, the start-up check of the route to it (telemachus/startup.py): DATABASE_URL
through a connection pooler without TELEMACHUS_PGBOUNCER stops `make run` here, with one line
naming the setting, before `migrate` would run through the pooler."""

from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from psycopg import sql

from telemachus.startup import database_route_check

CONNECT_TIMEOUT = 5
MAINTENANCE_DB = "postgres"
# Django's own OPTIONS, not libpq connection parameters.
DJANGO_OPTIONS = {"pool", "isolation_level", "server_side_binding", "assume_role", "cursor_factory", "context"}


class Command(BaseCommand):
    help = (
        "Create the database DATABASE_URL names if it is missing (PostgreSQL: when its role may; "
        "otherwise print the createdb command to run). Safe to run again."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        config = settings.DATABASES["default"]
        if config["ENGINE"] == "django.db.backends.sqlite3":
            Path(config["NAME"]).parent.mkdir(parents=True, exist_ok=True)
        elif config["ENGINE"] == "django.db.backends.postgresql":
            self.postgres_ensure(config)
            database_route_check()

    def postgres_ensure(self, config: dict[str, Any]) -> None:
        name = config["NAME"]
        where = f"{config.get('HOST') or 'the local socket'}:{config.get('PORT') or 5432}"
        try:
            psycopg.connect(**connect_params(config, name)).close()
            return
        except psycopg.OperationalError as exc:
            first_error = one_line(exc)
        # Not reachable as configured: ask the maintenance database whether `name` exists (the
        # server's wording of the failure depends on its locale; this does not).
        try:
            maintenance = psycopg.connect(**connect_params(config, MAINTENANCE_DB), autocommit=True)
        except psycopg.OperationalError as exc:
            raise CommandError(
                f"Cannot connect to PostgreSQL database {name!r} at {where}: {first_error}\n"
                f"(and not to its {MAINTENANCE_DB!r} database either: {one_line(exc)}).\n"
                f"Is the server running (pg_isready -h {config.get('HOST') or 'localhost'} -p "
                f"{config.get('PORT') or 5432}) and are DATABASE_URL's user and password right? "
                "If the database is missing, create it:\n"
                f"    {createdb_command(config)}"
            ) from None
        with maintenance:
            if maintenance.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                raise CommandError(f"PostgreSQL database {name!r} at {where} exists but refuses us: {first_error}")
            try:
                maintenance.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            except psycopg.Error as exc:
                raise CommandError(
                    f"PostgreSQL database {name!r} does not exist at {where}, and user "
                    f"{config.get('USER') or '(default)'!r} may not create it ({one_line(exc)}).\n"
                    "Create it as a role that may (postgres, typically), owned by DATABASE_URL's user, "
                    "then run this again:\n"
                    f"    {createdb_command(config)}"
                ) from None
        self.stdout.write(f"created PostgreSQL database {name!r} at {where}")


def connect_params(config: dict[str, Any], dbname: str) -> dict[str, Any]:
    params = {key: value for key, value in config.get("OPTIONS", {}).items() if key not in DJANGO_OPTIONS}
    for key, setting in (("user", "USER"), ("password", "PASSWORD"), ("host", "HOST"), ("port", "PORT")):
        if config.get(setting):
            params[key] = config[setting]
    params.setdefault("connect_timeout", CONNECT_TIMEOUT)
    return {**params, "dbname": dbname}


def createdb_command(config: dict[str, Any]) -> str:
    """The createdb line for the missing database: run as `postgres`, owned by our user."""
    parts = ["createdb"]
    if config.get("HOST"):
        parts += ["-h", config["HOST"]]
    parts += ["-p", str(config.get("PORT") or 5432), "-U", "postgres"]
    if config.get("USER") and config["USER"] != "postgres":
        parts += ["-O", config["USER"]]
    return " ".join([*parts, config["NAME"]])


def one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
