"""Every use of Django's private internals, in one place.

The hot paths do a few things the ORM does not offer as public API: turn rows read by SQL
compiled once into model instances exactly as a queryset would, say that an instance now exists
in the database, read timestamps SQLite stored as text, run a statement on a cursor of their own
through Django's cursor wrappers, and find out whether the atomic block they run in is the
outermost durable one. Each of those reaches into attributes Django does not document. They
are named here, and only here, and tests/telemachus/db/test_internals.py pins each one against
the Django installed: an upgrade that moves any of them fails that test, loudly, before anything
silently reads rows wrong.

What is relied on (Django 5.2 and 6.0, both allowed by pyproject.toml):
  SQLCompiler    `select`, `klass_info`, `annotation_col_map` (after `as_sql()` or
                 `setup_query()`), `get_converters()`, `apply_converters()`: what
                 `QuerySet.__iter__` uses (django.db.models.query.ModelIterable);
                 `get_related_populators(klass_info, select, db)`, the same module's helper.
  Model          `_state.adding`, `_state.db`: what `save()` and `bulk_create` set.
  QuerySet       `_iterable_class`: whether it yields instances or values rows.
  Connection     `atomic_blocks` (the stack of open `Atomic` blocks, each with `durable` and,
                 when a test case opened it, `_from_testcase`), `needs_rollback`,
                 `queries_logged`; `ops.convert_datetimefield_value` (SQLite's operations).
  psycopg loader Django compares the `timezone` attribute of the connection's `timestamptz`
                 loader before each cursor (telemachus/db/timestamps.py).
  psycopg query  `psycopg._queries.MAX_CACHED_STATEMENT_LENGTH` and `_PARAMS`, read at each
                 execute: above them a query's `%s` conversion is redone every time.
"""

from collections.abc import Callable, Sequence
from typing import Any

import psycopg._queries
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models import Model, QuerySet
from django.db.models.query import ModelIterable, get_related_populators
from django.db.models.sql.compiler import SQLCompiler


class CompiledRows:
    """What a compiled query's compiler knows about turning its rows into instances: the model and
    which columns are its fields, the converters of every column, the related models
    (`select_related`) and the annotations, as `QuerySet.__iter__` reads them."""

    def __init__(self, compiler: SQLCompiler, using: str) -> None:
        select, klass_info = compiler.select, compiler.klass_info
        self.compiler = compiler
        self.using = using
        self.columns: list[Any] = [column[0] for column in select]
        self.converters = compiler.get_converters(self.columns)
        self.model: type[Model] | None = None
        self.attnames: list[str] = []
        self.related: list[Any] = []
        self.start = self.end = 0
        self.annotations = list(compiler.annotation_col_map.items())
        if klass_info is not None:
            self.model = klass_info["model"]
            fields = klass_info["select_fields"]
            self.start, self.end = fields[0], fields[-1] + 1
            self.attnames = [column[0].target.attname for column in select[self.start : self.end]]
            # django-stubs describe Django 6.1's signature (a fetch mode); 5.2 and 6.0, which
            # pyproject.toml allows, take three arguments.
            self.related = get_related_populators(klass_info, select, using)  # type: ignore[call-arg]

    def converted(self, rows: Any) -> Any:
        """The rows with each column converted as the ORM converts it (JSON parsed, SQLite's text
        timestamps read, ...)."""
        return self.compiler.apply_converters(rows, self.converters) if self.converters else rows

    def targets(self) -> list[Any]:
        """The model fields the columns read (for a query of plain columns)."""
        return [column.target for column in self.columns]


def compiled_rows(compiler: SQLCompiler, using: str, *, setup: bool = False) -> CompiledRows:
    """The recipe of a compiler that has compiled its query (`as_sql()`), or of one that only needs
    its columns worked out (`setup`)."""
    if setup:
        compiler.setup_query()
    return CompiledRows(compiler, using)


def gives_instances(queryset: QuerySet[Any, Any]) -> bool:
    """Whether the queryset yields model instances (not `values()` or `values_list()` rows)."""
    return queryset._iterable_class is ModelIterable


def instance_saved(obj: Model, using: str) -> None:
    """Mark an instance whose row was just written by our own statement as stored, as `save()`
    and `bulk_create` mark theirs."""
    obj._state.adding, obj._state.db = False, using


def sqlite_datetime(value: Any, connection: BaseDatabaseWrapper) -> Any:
    """A timestamp SQLite returned as text, read as the ORM reads it (aware, UTC)."""
    convert: Callable[..., Any] = connection.ops.convert_datetimefield_value  # type: ignore[attr-defined]
    return convert(value, None, connection)


def wrapped_cursor(using: str, raw_cursor: Any) -> CursorWrapper:
    """A raw driver cursor of our own (one that prepares its statements, say) behind Django's own
    wrappers, so its statements are logged and pass through execute wrappers like any other."""
    db = connections[using]
    wrapper = CursorDebugWrapper if db.queries_logged else CursorWrapper
    return wrapper(raw_cursor, db)


def atomic_outermost_durable(connection: BaseDatabaseWrapper) -> bool:
    """Whether the innermost open atomic block is a durable one that the code itself opened and
    that no other block of the code's encloses (blocks a test case opened around a test are not
    the code's own: Django's own test for `durable`)."""
    blocks: Sequence[Any] = connection.atomic_blocks
    own = [block for block in blocks if not getattr(block, "_from_testcase", False)]
    return len(own) == 1 and bool(getattr(own[0], "durable", False)) and blocks[-1] is own[0]


def atomic_in_test_case(connection: BaseDatabaseWrapper) -> bool:
    """Whether a test case's atomic block encloses the code's (its transaction must not end)."""
    return any(getattr(block, "_from_testcase", False) for block in connection.atomic_blocks)


def rollback_pending(connection: BaseDatabaseWrapper) -> bool:
    """Whether the transaction is marked to roll back when its atomic block ends."""
    return bool(connection.needs_rollback)


def query_conversion_cached(*, length: int, params: int) -> None:
    """Let psycopg keep its conversion of `%s` queries up to `length` characters and `params`
    parameters (its defaults: 4,096 and 50). Above them it converts the query again at every
    execute, which for the submit's single statement (one array per job column, over 50 of them)
    cost 1.3 ms of a 2.4 ms submit: more than the database's whole share. The cache is psycopg's
    own (an LRU of 128 queries), so this only widens which queries it holds."""
    queries: Any = psycopg._queries
    queries.MAX_CACHED_STATEMENT_LENGTH = max(queries.MAX_CACHED_STATEMENT_LENGTH, length)
    queries.MAX_CACHED_STATEMENT_PARAMS = max(queries.MAX_CACHED_STATEMENT_PARAMS, params)
