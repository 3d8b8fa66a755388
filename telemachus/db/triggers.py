"""A version counter that database triggers bump on every write to the tables it watches, whoever
writes (a service, the admin, a queryset `.update()`, a shell, psql), in the writer's transaction:
the configuration version (telemachus/control/config.py) is one. Installed by migrations, as
RunPython operations built here.

A version row created anew (a flushed test database, a deleted row, a restored backup) starts at
the database clock in milliseconds rather than at 1, so it does not repeat versions that some
process still has cached with other rows behind them."""

from collections.abc import Iterable
from typing import Any

from django.db.migrations import RunPython

BUMP_FUNCTION = "telemachus_config_bump"
FRESH_VERSION_SQL = {
    "postgresql": "(extract(epoch from clock_timestamp()) * 1000)::bigint",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
}


def bump_function(version_table: str, *, notify_channel: str, notify_payload: str) -> RunPython:
    """PostgreSQL: the trigger function every watched table calls, which bumps the version row
    (id 1) of `version_table` and sends `notify_payload` on `notify_channel` (at commit). SQLite's
    triggers inline the bump (and SQLite has no notifications). Changing it takes a migration."""

    def forwards(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        schema_editor.execute(
            f"CREATE OR REPLACE FUNCTION {BUMP_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"INSERT INTO {version_table} (id, version) VALUES (1, {FRESH_VERSION_SQL['postgresql']}) "
            f"ON CONFLICT (id) DO UPDATE SET version = {version_table}.version + 1; "
            f"PERFORM pg_notify('{notify_channel}', '{notify_payload}'); "
            "RETURN NULL; END $$"
        )

    def backwards(apps: Any, schema_editor: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"DROP FUNCTION IF EXISTS {BUMP_FUNCTION}()")

    return RunPython(forwards, backwards)


def bump_triggers(
    model: str,
    *,
    version_table: str,
    m2m: str | None = None,
    only: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    replace: bool = False,
) -> RunPython:
    """The triggers on the table of `model` (or of its `m2m` field's through table) that bump the
    version on every insert and delete, and on every update or, with `only` or `ignore`, an
    update that changes one of those columns (field names), as they are at this migration.
    `replace` drops the table's triggers first."""
    fixed_only, fixed_ignore = (tuple(only) if only is not None else None), tuple(ignore)

    def target(apps: Any) -> tuple[str, list[str] | None]:
        cls = apps.get_model(model)
        if m2m is not None:
            cls = cls._meta.get_field(m2m).remote_field.through
        if fixed_only is None and not fixed_ignore:
            return cls._meta.db_table, None
        fields = [
            f
            for f in cls._meta.concrete_fields
            if (fixed_only is None or f.name in fixed_only) and f.name not in fixed_ignore
        ]
        return cls._meta.db_table, [f.column for f in fields]

    def forwards(apps: Any, schema_editor: Any) -> None:
        table, columns = target(apps)
        if replace:
            for sql in _drop_sql(schema_editor.connection, table):
                schema_editor.execute(sql)
        for sql in _trigger_sql(schema_editor.connection, table, columns, version_table):
            schema_editor.execute(sql)

    def backwards(apps: Any, schema_editor: Any) -> None:
        table, _ = target(apps)
        for sql in _drop_sql(schema_editor.connection, table):
            schema_editor.execute(sql)

    return RunPython(forwards, backwards)


def _trigger_sql(db: Any, table: str, columns: list[str] | None, version: str) -> list[str]:
    qn = db.ops.quote_name
    name = f"telemachus_config_{table}"
    if db.vendor == "postgresql":
        changed = (
            f" WHEN (({', '.join(f'OLD.{qn(c)}' for c in columns)}) IS DISTINCT FROM "
            f"({', '.join(f'NEW.{qn(c)}' for c in columns)}))"
            if columns
            else ""
        )
        return [
            f"CREATE TRIGGER {name}_write AFTER INSERT OR DELETE ON {qn(table)} "
            f"FOR EACH ROW EXECUTE FUNCTION {BUMP_FUNCTION}()",
            f"CREATE TRIGGER {name}_edit AFTER UPDATE ON {qn(table)} "
            f"FOR EACH ROW{changed} EXECUTE FUNCTION {BUMP_FUNCTION}()",
        ]
    bump = (
        f"BEGIN INSERT INTO {version} (id, version) VALUES (1, {FRESH_VERSION_SQL['sqlite']}) "
        f"ON CONFLICT (id) DO UPDATE SET version = version + 1; END"
    )
    changed = f" WHEN NOT ({' AND '.join(f'OLD.{qn(c)} IS NEW.{qn(c)}' for c in columns)})" if columns else ""
    return [
        f"CREATE TRIGGER {name}_insert AFTER INSERT ON {qn(table)} {bump}",
        f"CREATE TRIGGER {name}_delete AFTER DELETE ON {qn(table)} {bump}",
        f"CREATE TRIGGER {name}_edit AFTER UPDATE ON {qn(table)}{changed} {bump}",
    ]


def _drop_sql(db: Any, table: str) -> list[str]:
    qn = db.ops.quote_name
    name = f"telemachus_config_{table}"
    if db.vendor == "postgresql":
        return [f"DROP TRIGGER IF EXISTS {name}_{op} ON {qn(table)}" for op in ("write", "edit")]
    return [f"DROP TRIGGER IF EXISTS {name}_{op}" for op in ("insert", "delete", "edit")]
