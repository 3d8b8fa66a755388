"""Rows read by our own SQL, turned into what the ORM would have given: the one row mapper.

A statement built here (a compiled query, a RETURNING clause, the claim's lookups) returns plain
driver rows; `RowMapper` turns them into model instances, or into tuples of converted values, with
the same converters, deferred fields, related models and annotations a queryset applies. It is
worked out once per query shape (or per model and columns) and database connection: working it out
on every claim cost about a third of reading the queue's heads (measured in-process on
PostgreSQL)."""

import threading
from collections.abc import Sequence
from typing import Any, Generic, TypeVar, cast

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Model
from django.db.models.sql.compiler import SQLCompiler

from telemachus.db.internals import CompiledRows, compiled_rows, instance_saved

M = TypeVar("M", bound=Model)


class RowMapper(Generic[M]):
    """Driver rows of a query's columns into instances or converted values."""

    def __init__(self, recipe: CompiledRows) -> None:
        self.recipe = recipe
        self.using = recipe.using

    @classmethod
    def of_compiler(cls, compiler: SQLCompiler, using: str) -> "RowMapper[Any]":
        """The mapper of a compiler that compiled its query (`as_sql()`)."""
        return cls(compiled_rows(compiler, using))

    @classmethod
    def of_fields(cls, model: type[M], fields: Sequence[str], *, using: str = DEFAULT_DB_ALIAS) -> "RowMapper[M]":
        """The mapper of rows holding these fields of `model`, in the order `columns` gives (the
        primary key first, as `only()` puts it). Cached per thread, as Django's connections are."""
        cache: dict[tuple[Any, ...], RowMapper[Any]] = _cache()
        key = (model, tuple(fields), using, id(connections[using]))
        found = cache.get(key)
        if found is None:
            query = model._default_manager.using(using).only(*fields).query
            found = cache[key] = cls(compiled_rows(query.get_compiler(using=using), using, setup=True))
        return cast(RowMapper[M], found)

    @property
    def columns(self) -> list[str]:
        """The quoted column names, in the order the rows must hold them."""
        quote = connections[self.using].ops.quote_name
        return [quote(target.column) for target in self.recipe.targets()]

    def instances(self, rows: Any) -> list[M]:
        """Model instances, as a queryset would give them (fields not read are deferred)."""
        recipe = self.recipe
        assert recipe.model is not None, "a query of model rows"
        model, using, attnames = recipe.model, self.using, recipe.attnames
        start, end = recipe.start, recipe.end
        found = []
        for row in recipe.converted(rows):
            obj = model.from_db(using, attnames, row[start:end])
            for populator in recipe.related:
                populator.populate(row, obj)
            for name, position in recipe.annotations:
                setattr(obj, name, row[position])
            found.append(obj)
        return cast(list[M], found)

    def values(self, rows: Any) -> list[tuple[Any, ...]]:
        """Each row's values, converted as the ORM converts each column."""
        return [tuple(row) for row in self.recipe.converted(rows)]


def rows_stored(objs: Sequence[Model], keys: Sequence[Any], *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Give instances just inserted by our own statement their primary keys, and mark them stored."""
    for obj, pk in zip(objs, keys, strict=True):
        obj.pk = pk
        instance_saved(obj, using)


_local = threading.local()


def _cache() -> dict[tuple[Any, ...], Any]:
    found: dict[tuple[Any, ...], Any] | None = getattr(_local, "mappers", None)
    if found is None:
        found = _local.mappers = {}
    return found
