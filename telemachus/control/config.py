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

from telemachus.control.notify import CONFIG_CHANGED, WORKERS_CHANNEL
from telemachus.db.triggers import bump_function, bump_triggers
from telemachus.errors import DomainError
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


class StaleConfiguration(Exception):
    """A statement found the configuration at another version than the snapshot the caller
    checked against (`version`: the one it found)."""

    def __init__(self, version: int | None) -> None:
        super().__init__(f"the configuration is at version {version}")
        self.version = version


def config_believed(
    check: Callable[[ConfigSnapshot], T],
    *,
    confirmed: bool = False,
    refusals: tuple[type[Exception], ...] = (DomainError,),
) -> T:
    """`check(snapshot)` against the snapshot this process last used (no query; `confirmed`: the
    version now, one query), believing what it says only from configuration known to be current.
    A refusal (`refusals`) from an unconfirmed snapshot is checked again on a fresh read; a
    StaleConfiguration (the check's own statement found another version) runs it again on that
    version's snapshot. The one loop every caller of unconfirmed configuration goes through."""
    snapshot, fresh = (config_snapshot(), True) if confirmed else config_current()
    while True:
        try:
            return check(snapshot)
        except StaleConfiguration as stale:
            # The same version with different rows can only be a rolled-back or flushed database.
            same = (stale.version or 0) == snapshot.version
            snapshot, fresh = (config_reload if same else config_at)(stale.version), True
        except refusals:
            if fresh:
                raise
            snapshot, fresh = config_snapshot(), True


def config_cache_clear() -> None:
    """Forget every snapshot (tests: a flushed or rolled-back database can repeat a version)."""
    global _current
    _current = ConfigSnapshot(-1)


# --- the triggers (installed by migrations: telemachus/db/triggers.py) ---------------------------


def install_bump_function() -> RunPython:
    """PostgreSQL: the trigger function every watched table calls (SQLite triggers inline it); it
    also wakes the workers (`config` on their channel)."""
    return bump_function(ConfigVersion._meta.db_table, notify_channel=WORKERS_CHANNEL, notify_payload=CONFIG_CHANGED)


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
    return bump_triggers(
        model, version_table=ConfigVersion._meta.db_table, m2m=m2m, only=only, ignore=ignore, replace=replace
    )
