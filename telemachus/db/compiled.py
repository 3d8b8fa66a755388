"""Hot queries compiled once.

Django turns a queryset into SQL each time it runs it: it builds the query, resolves every
expression and join, quotes every name. For the one-row lookups on every governed call's path
that costs more than the query itself: a personal token's lookup took 0.65 ms of CPU through the
ORM and 0.19 ms run from SQL compiled once (measured in-process on PostgreSQL, 1,000 lookups,
best of five). A `CompiledQuery` builds its queryset once per shape (the length of each list it
is given) and database, keeps Django's compiler, and runs the same SQL with new values, turning
rows into model instances as the ORM does (converters, `select_related` models, annotations and
deferred fields included).

Values are found in the compiled parameters by sentinels of their kind: an integer no column
holds, or a string no caller sends. A sentinel the ORM rewrote or dropped (a lookup that
transforms its value) is refused when the query is first compiled, so a query that cannot be
compiled this way fails in the tests, never gives other rows.

Values or plain rows: a `values()`/`values_list()` queryset (or one of aggregates) gives tuples
of converted values; a model queryset gives instances. Either way through telemachus/db/rows.py,
the one row mapper.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from django.db import connections
from django.db.models import QuerySet

from telemachus.db.internals import gives_instances
from telemachus.db.pipeline import sent
from telemachus.db.rows import RowMapper

# A row: a model instance, or a tuple of values.
R = TypeVar("R")
Values = int | str | Sequence[int] | Sequence[str]

# Far below any id or count a column of ours holds; each value gets its own.
_INT_SENTINEL = -(2**62)
_STR_SENTINEL = "\x00telemachus-compiled-{}"


class _Compiled:
    """One shape's SQL, where each value goes in its parameters, and its rows' mapper."""

    def __init__(self, queryset: QuerySet[Any], slots: dict[Any, tuple[str, int | None]], using: str) -> None:
        compiler = queryset.query.get_compiler(using=using)
        sql, params = compiler.as_sql()
        found = [slots.get(param) if isinstance(param, int | str) else None for param in params]
        placed = [slot for slot in found if slot is not None]
        if len(placed) != len(slots) or set(placed) != set(slots.values()):
            raise ValueError(f"{queryset.model.__name__}: a value was rewritten by its lookup; it cannot be compiled")
        self.sql = sql
        # Each parameter: the slot of a value (name, index in its list or None), or a constant.
        self.recipe = list(zip(found, params, strict=True))
        self.using = using
        self.mapper: RowMapper[Any] = RowMapper.of_compiler(compiler, using)
        self.model_rows = gives_instances(queryset)

    def sent(self, values: dict[str, Values]) -> Callable[[], list[Any]]:
        """Execute now, read the rows when the result is called (see `CompiledQuery.sent`)."""
        params = [constant if slot is None else _value(values, *slot) for slot, constant in self.recipe]
        rows = self.mapper.instances if self.model_rows else self.mapper.values
        return sent(self.sql, params, rows, using=self.using)


class CompiledQuery(Generic[R]):
    """`build(**values)` gives the queryset; calling this gives its rows, from SQL compiled once
    per database and per length of each list value. Values are ints, strings or lists of one of
    them, as the columns hold them (no lookup may transform them)."""

    def __init__(self, build: Callable[..., QuerySet[Any, Any]], *, using: str = "default") -> None:
        self.build = build
        self.using = using
        self._shapes: dict[tuple[Any, ...], _Compiled] = {}
        self._lock = threading.Lock()

    def __call__(self, **values: Values) -> list[R]:
        """The rows. A list value that is empty matches nothing (as `__in` of nothing does)."""
        if any(not isinstance(v, int | str) and not v for v in values.values()):
            return []
        return self._shape(values).sent(values)()

    def _shape(self, values: dict[str, Values]) -> _Compiled:
        connection = connections[self.using]
        shape = (
            connection.vendor,
            *((name, None if isinstance(v, int | str) else (len(v), _kind(v))) for name, v in sorted(values.items())),
        )
        compiled = self._shapes.get(shape)
        if compiled is None:
            compiled = self._compile(values)
            with self._lock:
                self._shapes[shape] = compiled
        return compiled

    def sent(self, **values: Values) -> Callable[[], list[R]]:
        """The query executed now, its rows read when the result is called: inside
        telemachus.db.pipeline.together() it goes with the block's other statements."""
        if any(not isinstance(v, int | str) and not v for v in values.values()):
            return list
        return self._shape(values).sent(values)

    def first(self, **values: Values) -> R | None:
        found = self(**values)
        return found[0] if found else None

    def _compile(self, values: dict[str, Values]) -> _Compiled:
        slots: dict[Any, tuple[str, int | None]] = {}
        stand_ins: dict[str, Any] = {}
        for name, value in sorted(values.items()):
            if isinstance(value, int | str):
                stand_ins[name] = self._sentinel(type(value), slots, (name, None))
            else:
                kind = _kind(value)
                stand_ins[name] = [self._sentinel(kind, slots, (name, i)) for i in range(len(value))]
        return _Compiled(self.build(**stand_ins), slots, self.using)

    @staticmethod
    def _sentinel(kind: type, slots: dict[Any, tuple[str, int | None]], slot: tuple[str, int | None]) -> Any:
        sentinel: Any = _INT_SENTINEL - len(slots) if kind is int else _STR_SENTINEL.format(len(slots))
        slots[sentinel] = slot
        return sentinel


def _value(values: dict[str, Values], name: str, index: int | None) -> Any:
    value = values[name]
    return value if index is None else value[index]  # type: ignore[index]


def _kind(values: Sequence[Any]) -> type:
    return str if values and isinstance(values[0], str) else int
