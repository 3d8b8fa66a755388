"""Timestamps read from PostgreSQL by psycopg's C loader instead of Django's Python one.

With USE_TZ, Django (5.2 and 6.0) registers on each connection a `timestamptz` loader that
subclasses psycopg's pure-Python loader, parses the text with a regular expression and replaces
the tzinfo, even when psycopg's C extension is installed: about 5 µs per value. Every claim and
finish reads job rows with several timestamps each; in the profile of one /v1/ call at one
client (bench/gateway.py, py-spy) that parsing was an eighth of the claim's CPU.

Django sets each connection's TimeZone to its own (UTC here: TIME_ZONE = "UTC" and no per-database
TIME_ZONE), and psycopg's C loader returns a value aware in the connection's TimeZone, which is
`datetime.timezone.utc` for UTC: the same value and the same tzinfo object Django's loader gives,
in about a third of the time. The C loader cannot be subclassed, and Django reads a `timezone`
attribute from the connection's loader before each cursor to decide whether to register its own,
so the loader here is a thin Python class that holds the C one. A connection with a per-database
TIME_ZONE (even "UTC", which Django reads as a ZoneInfo) keeps Django's loader; so do SQLite and
psycopg without its C extension (the C loader is then psycopg's Python one, no faster)."""

import datetime
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

UTC = datetime.UTC


def _c_loader() -> type | None:
    """psycopg's C `timestamptz` text loader, or None (no psycopg 3, or no C extension)."""
    try:
        import psycopg
        from psycopg.pq import Format
    except ImportError:
        return None
    loader = psycopg.adapters.get_loader(psycopg.adapters.types["timestamptz"].oid, Format.TEXT)
    return loader if loader is not None and loader.__module__.endswith("_psycopg") else None


_C_LOADER = _c_loader()

if _C_LOADER is not None:
    from psycopg.adapt import Loader

    _C: type = _C_LOADER

    class UtcTimestamptzLoader(Loader):
        """psycopg's C loader, with the `timezone` attribute Django compares before each cursor."""

        timezone = UTC

        def __init__(self, oid: int, context: Any = None) -> None:
            super().__init__(oid, context)
            self._c = _C(oid, context)
            session = context.connection if context is not None else None
            if session is None or session.info.timezone is UTC:
                # The C loader's bound method, called by the row maker with no Python frame between.
                self.load = self._c.load  # type: ignore[method-assign]

        def load(self, data: Any) -> datetime.datetime:
            """A session whose TimeZone someone changed: the same instant, in UTC (Django's loader
            would keep the local time and call it UTC). At the ends of the range, where the
            instant has no UTC date (year 1 east of Greenwich), the value as the server gave it."""
            value: datetime.datetime = self._c.load(data)
            try:
                return value.astimezone(UTC)
            except OverflowError:
                return value


def timestamps_fast(*, connection: BaseDatabaseWrapper, **_: Any) -> None:
    """On a new PostgreSQL connection in UTC, read timestamps with the C loader (connected to
    `connection_created` by telemachus/apps.py)."""
    if _C_LOADER is None or connection.vendor != "postgresql" or connection.timezone is not UTC:
        return
    raw = connection.connection
    if raw is not None and hasattr(raw, "adapters"):
        raw.adapters.register_loader("timestamptz", UtcTimestamptzLoader)
