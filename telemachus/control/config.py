"""The configuration version, and a per-process cache of configuration reads behind it.

Configuration is what every claim and every submit reads but that changes only when someone
changes it: executors (with their breaker and health), teams, memberships, permissions, quota
rules, the queue policy. Database triggers bump one counter, `ConfigVersion.version`, in the
transaction of any write to those tables, whoever writes (a service, the admin, a queryset
`.update()`, a shell, psql), and on PostgreSQL send `config` on the workers' channel
(telemachus/control/notify.py), which wakes the workers: a configuration change may raise a cap or
make queued work placeable.

A process keeps what it read under the version it read it at (`config_at(version)`), and reads
again only when the version has moved. Callers learn the version from a statement they run anyway
(`version_annotation()`), so an unchanged configuration costs no round trip; several processes on
several hosts stay correct because the version lives in the database and moves in the same
transaction as the change. What changes with the work itself is never cached: slot counts, the
usage ledger, fair-share usage, the queue.

Cached values are shared by every caller in the process until the version moves: treat them as
read-only.
"""

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from django.db.migrations import RunPython
from django.db.models import Subquery

from telemachus.control.notify import config_notify_plpgsql
from telemachus.models import ConfigVersion

T = TypeVar("T")


def version_annotation() -> Subquery:
    """The configuration version as a column, for a statement the caller runs anyway."""
    return Subquery(ConfigVersion.objects.filter(pk=ConfigVersion.SINGLETON_ID).values("version")[:1])


def config_version() -> int:
    """The configuration version now (one query); 0 before any configuration was written."""
    version = ConfigVersion.objects.filter(pk=ConfigVersion.SINGLETON_ID).values_list("version", flat=True).first()
    return version or 0


class ConfigSnapshot:
    """Configuration reads made under one version. `get` loads a value on first use."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._values: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: str, load: Callable[[], T]) -> T:
        try:
            return self._values[key]
        except KeyError:
            pass
        value = load()
        with self._lock:
            return self._values.setdefault(key, value)


_current = ConfigSnapshot(-1)


def config_at(version: int | None) -> ConfigSnapshot:
    """The process's snapshot for `version` (as read from the database; None: no row yet), a new
    empty one when the version moved. A thread that read an older version than the current
    snapshot's gets a snapshot of its own, so values are never filed under a later version than the
    one read before loading them."""
    global _current
    version = version or 0
    snapshot = _current
    if snapshot.version != version:
        snapshot = ConfigSnapshot(version)
        _current = snapshot
    return snapshot


def config_snapshot() -> ConfigSnapshot:
    """The snapshot for the version now (one query)."""
    return config_at(config_version())


def config_current() -> tuple[ConfigSnapshot, bool]:
    """The snapshot this process last used, not confirmed (no query), for a caller that confirms
    the version later in a statement of its own; or, in a process that has none yet, the snapshot
    for the version now. The flag says whether it was just confirmed."""
    snapshot = _current
    if snapshot.version < 0:
        return config_snapshot(), True
    return snapshot, False


def config_reload(version: int | None) -> ConfigSnapshot:
    """A new, empty snapshot for `version`, replacing one that turned out not to match the
    database (a rolled-back or flushed test database can repeat a version)."""
    global _current
    _current = ConfigSnapshot(version or 0)
    return _current


def config_cache_clear() -> None:
    """Forget every snapshot (tests: a flushed or rolled-back database can repeat a version)."""
    global _current
    _current = ConfigSnapshot(-1)


# --- the triggers (installed by migrations) -----------------------------------------------------

BUMP_FUNCTION = "telemachus_config_bump"
# A version row created anew (a flushed test database, a deleted row, a restored backup) starts at
# the database clock in milliseconds rather than at 1, so it does not repeat versions that some
# process still has cached with other rows behind them.
FRESH_VERSION_SQL = {
    "postgresql": "(extract(epoch from clock_timestamp()) * 1000)::bigint",
    "sqlite": "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)",
}


def _version_table() -> str:
    return ConfigVersion._meta.db_table


def install_bump_function() -> RunPython:
    """PostgreSQL: the trigger function every watched table calls (SQLite triggers inline it)."""
    table = _version_table()

    def forwards(apps, schema_editor) -> None:
        if schema_editor.connection.vendor != "postgresql":
            return
        schema_editor.execute(
            f"CREATE OR REPLACE FUNCTION {BUMP_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"INSERT INTO {table} (id, version) VALUES (1, {FRESH_VERSION_SQL['postgresql']}) "
            f"ON CONFLICT (id) DO UPDATE SET version = {table}.version + 1; "
            f"{config_notify_plpgsql()} "
            "RETURN NULL; END $$"
        )

    def backwards(apps, schema_editor) -> None:
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"DROP FUNCTION IF EXISTS {BUMP_FUNCTION}()")

    return RunPython(forwards, backwards)


def watch_config(
    model: str,
    *,
    m2m: str | None = None,
    only: Iterable[str] | None = None,
    ignore: Iterable[str] = (),
    replace: bool = False,
) -> RunPython:
    """A migration operation: every insert and delete on the table of `model` (or of its `m2m`
    field's through table) bumps the configuration version, and so does every update, or, with
    `only` or `ignore`, an update that changes one of those columns (field names), as they are at
    this migration. A later migration that adds a column to a table watched with `only` or
    `ignore` must watch it again, and so must one that alters a column of a watched table (SQLite
    rebuilds the table, losing its triggers): `replace` drops the table's triggers first."""
    only, ignore = (tuple(only) if only is not None else None), tuple(ignore)

    def target(apps) -> tuple[str, list[str] | None]:
        cls = apps.get_model(model)
        if m2m is not None:
            cls = cls._meta.get_field(m2m).remote_field.through
        if only is None and not ignore:
            return cls._meta.db_table, None
        fields = [f for f in cls._meta.concrete_fields if (only is None or f.name in only) and f.name not in ignore]
        return cls._meta.db_table, [f.column for f in fields]

    def forwards(apps, schema_editor) -> None:
        table, columns = target(apps)
        if replace:
            for sql in _drop_sql(schema_editor.connection, table):
                schema_editor.execute(sql)
        for sql in _trigger_sql(schema_editor.connection, table, columns):
            schema_editor.execute(sql)

    def backwards(apps, schema_editor) -> None:
        table, _ = target(apps)
        for sql in _drop_sql(schema_editor.connection, table):
            schema_editor.execute(sql)

    return RunPython(forwards, backwards)


def _trigger_sql(db: Any, table: str, columns: list[str] | None) -> list[str]:
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
    version = _version_table()
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
