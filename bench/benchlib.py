"""What the benchmark scripts share: percentiles, and the scratch PostgreSQL database each one
creates, runs in and drops (on the server that BENCH_PG_URL names, 127.0.0.1 by default)."""

import os

PG_ADMIN_URL = os.environ.get("BENCH_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pg_url(database: str) -> str:
    """DATABASE_URL of a database on the same server as PG_ADMIN_URL."""
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{database}"


def pg_database(database: str, action: str) -> None:
    """Drop the database if it exists (with its connections), then create it when `action` is
    "create"."""
    import psycopg

    with psycopg.connect(PG_ADMIN_URL.replace("postgres://", "postgresql://"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if action == "create":
            conn.execute(f'CREATE DATABASE "{database}"')
