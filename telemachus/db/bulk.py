"""Many rows in one statement: per-row updates, inserts, deletes and upserts, with their SQL built
from the models' own fields, for the hot paths (the claim, the finish, the ledgers).

Django's bulk_update builds a CASE WHEN per row per field, which costs more Python time than the
whole rest of a finish, and bulk_create compiles its query on every call (about a third of the
Python time of the claim's slot and event inserts). These write
`WITH v(...) AS (VALUES ...) UPDATE ... FROM v` (PostgreSQL, and SQLite 3.33+; 3.35+ with
RETURNING) and, on PostgreSQL, one INSERT through UNNEST whose SQL is built once per model, with
each value prepared by its field as the ORM prepares it (`get_db_prep_save`); many rows whose
keys nobody reads back (a batch's lines) go by COPY on PostgreSQL (`rows_copy`).

Each statement can carry riders (telemachus/db/statements.py): the events and the notice that go
with a change, in the same round trip."""

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import connection
from django.db.models import Field, JSONField, Model

from telemachus.db.locks import Level, for_update_sql
from telemachus.db.rows import RowMapper, rows_stored
from telemachus.db.statements import (
    NO_RIDERS,
    Riders,
    Statement,
    default_connection,
    riding_supported,
    send,
    sent_rows,
)

M = TypeVar("M", bound=Model)


def _field(model: type[Model], name: str) -> "Field[Any, Any]":
    found = model._meta.get_field(name)
    if not isinstance(found, Field):
        raise TypeError(f"{model.__name__}.{name} is not a column")
    return found


def _cast(field: "Field[Any, Any]") -> str:
    """The placeholder of one value of `field` in a VALUES list: typed on PostgreSQL, which
    cannot infer a VALUES column's type from its use."""
    return f"%s::{field.cast_db_type(connection)}" if connection.vendor == "postgresql" else "%s"


def update_statement(
    model: type[Model],
    rows: Sequence[Mapping[str, Any]],
    *,
    key: str = "id",
    where: Mapping[str, Any] | None = None,
    expect: Sequence[Mapping[str, Any]] = (),
    lock: Level | None = None,
    returning: Sequence[str] = (),
) -> Statement:
    """Set each row's fields (mapping keys, field names; the same in every row) where `key`
    matches. `where`: conditions every updated row must meet as it stands (field = value); with
    `lock` the rows are first locked, skipping those another transaction holds (SKIP LOCKED, at
    that level of the lock order: telemachus/db/locks.py), so an update that would wait is left
    out instead (PostgreSQL; SQLite serializes writers). `expect`: for each row, fields whose
    stored value must still be the given one (an optimistic check that what the caller read has
    not changed since). `returning`: fields the statement returns for each row it updated, the
    key first (RETURNING's order), as raw values (`returned` converts them)."""
    names = [key, *(name for name in rows[0] if name != key)]
    checked = list(expect[0]) if expect else []
    fields = [_field(model, name) for name in names] + [_field(model, name) for name in checked]
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    columns = [qn(str(field.column)) for field in fields]
    kept = columns[len(names) :]
    expected = [f"was{i}" for i in range(len(checked))]
    placeholder = "(" + ", ".join(_cast(field) for field in fields) + ")"
    sets = ", ".join(f"{c} = v.{c}" for c in columns[1 : len(names)])
    conditions, params = [], []
    for name, value in (where or {}).items():
        conditions.append(f"{qn(str(_field(model, name).column))} = %s")
        params.append(_field(model, name).get_db_prep_save(value, connection))
    for column, was in zip(kept, expected, strict=True):
        conditions.append(f"{column} IS NOT DISTINCT FROM v.{was}")
    if lock is not None and connection.features.has_select_for_update:
        found = " AND ".join(f"j.{c}" for c in conditions) or "true"
        filtered = (
            f"{table}.{columns[0]} IN (SELECT j.{columns[0]} FROM {table} j JOIN v ON j.{columns[0]} = v.{columns[0]} "
            f"WHERE {found}{for_update_sql(level=lock, of='j', skip_locked=True)})"
        )
    else:
        filtered = " AND ".join(f"{table}.{c}" for c in conditions)
    v = ", ".join([*columns[: len(names)], *expected])
    # Many rows on PostgreSQL: one array per column, so the statement's text is the same for any
    # number of rows and psycopg converts it once (a VALUES list of 64 finished jobs is 600
    # placeholders, parsed again at every execute: about a tenth of a worker's time).
    many = len(rows) > 1 and connection.vendor == "postgresql"
    source = (
        "SELECT * FROM UNNEST(" + ", ".join(f"%s::{field.cast_db_type(connection)}[]" for field in fields) + ")"
        if many
        else f"VALUES {', '.join([placeholder] * len(rows))}"
    )
    sql = (
        f"WITH v({v}) AS ({source}) "
        f"UPDATE {table} SET {sets} FROM v WHERE {table}.{columns[0]} = v.{columns[0]}"
        + (f" AND {filtered}" if filtered else "")
        + (
            f" RETURNING {', '.join(f'{table}.{qn(str(_field(model, r).column))}' for r in returning)}"
            if returning
            else ""
        )
    )
    values: list[Any] = []
    real = default_connection()
    if many:
        values += [[field.get_db_prep_save(row[field.name], real) for row in rows] for field in fields[: len(names)]]
        values += [[field.get_db_prep_save(was[field.name], real) for was in expect] for field in fields[len(names) :]]
        return Statement(sql, [*values, *params])
    for i, row in enumerate(rows):
        values += [field.get_db_prep_save(row[field.name], real) for field in fields[: len(names)]]
        if checked:
            values += [field.get_db_prep_save(expect[i][field.name], real) for field in fields[len(names) :]]
    return Statement(sql, [*values, *params])


def update_rows(
    model: type[Model], rows: Sequence[Mapping[str, Any]], *, key: str = "id", riders: Riders = NO_RIDERS
) -> None:
    """`update_statement` executed, reading nothing back, so it can go with other statements in
    one round trip (telemachus/db/pipeline.py). With `riders` it returns the key of each row it
    updates, which carries them (every row must exist)."""
    if not rows:
        return
    send(update_statement(model, rows, key=key, returning=[key] if riders else ()), riders)


def returned(model: type[M], fields: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """Rows a RETURNING clause of these fields gave, each value converted as the ORM converts it
    (JSON parsed, SQLite's text timestamps read)."""
    mapper = RowMapper.of_fields(model, fields)
    targets = [target.attname for target in mapper.recipe.targets()]
    order = [targets.index(_field(model, name).attname) for name in fields]
    padded = [_padded(row, order, len(targets)) for row in rows]
    return [tuple(values[i] for i in order) for values in mapper.values(padded)]


def _padded(row: Sequence[Any], order: list[int], width: int) -> list[Any]:
    """A row of `order`'s columns placed where the mapper's columns are (the rest None)."""
    full: list[Any] = [None] * width
    for value, position in zip(row, order, strict=False):
        full[position] = value
    return full


@dataclass(frozen=True)
class _Insert:
    """A model's INSERT, built once per database: its SQL, and how each column's value is read
    (the attribute, or `pre_save` for a field that sets its own, like auto_now) and prepared."""

    sql: str
    # One row: a SELECT of scalars (a SELECT, as the arrays' is, so a guard's WHERE may follow).
    # An array per column costs psycopg a dump per array and the server an UNNEST: for the one
    # job of a one-by-one submit, over half its time.
    sql_one: str
    keys: str
    columns: list[tuple[Field[Any, Any], str, bool, Callable[..., Any]]]

    def row(self, obj: Model) -> list[Any]:
        """The object's value of each column, prepared as `values` prepares them."""
        real = default_connection()
        return [
            None
            if (value := field.pre_save(obj, True) if own else obj.__dict__.get(attname)) is None
            else prep(value, real)
            for field, attname, own, prep in self.columns
        ]

    def values(self, objs: Sequence[Model]) -> list[list[Any]]:
        """One array per column. An empty value is NULL without its field's conversion: every
        field of ours stores None as NULL (tests/telemachus/db/test_bulk.py), and about 14 of a
        submitted job's 36 columns are empty."""
        arrays, real = [], default_connection()
        for field, attname, own, prep in self.columns:
            column = []
            for obj in objs:
                value = field.pre_save(obj, True) if own else obj.__dict__.get(attname)
                column.append(None if value is None else prep(value, real))
            arrays.append(column)
        return arrays


_INSERTS: dict[tuple[type[Model], str], _Insert] = {}


def _insert(model: type[Model]) -> _Insert:
    key = (model, connection.vendor)
    built = _INSERTS.get(key)
    if built is None:
        qn = connection.ops.quote_name
        fields = [f for f in model._meta.concrete_fields if not f.primary_key and not f.generated]
        columns = ", ".join(qn(str(f.column)) for f in fields)
        arrays = ", ".join(f"%s::{f.db_type(connection)}[]" for f in fields)
        scalars = ", ".join(f"%s::{f.db_type(connection)}" for f in fields)
        pk = model._meta.pk
        assert pk is not None
        built = _INSERTS[key] = _Insert(
            sql=f"INSERT INTO {qn(model._meta.db_table)} ({columns}) SELECT * FROM UNNEST({arrays})",
            sql_one=f"INSERT INTO {qn(model._meta.db_table)} ({columns}) SELECT {scalars}",
            keys=f" RETURNING {qn(str(pk.column))}",
            columns=[
                (
                    f,
                    f.attname,
                    bool(getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False)),
                    f.get_db_prep_save,
                )
                for f in fields
            ],
        )
    return built


def _sets_own_value(field: "Field[Any, Any]") -> bool:
    """A field whose `pre_save` sets the value it saves (auto_now, auto_now_add)."""
    return bool(getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False))


def insert_statement(model: type[Model], objs: Sequence[Model], *, returning: bool = False) -> Statement:
    """PostgreSQL: one INSERT of the unsaved `objs` (primary keys left to the database), one array
    per column through UNNEST as Django's bulk_create sends them (one object: a row of scalars), with
    each value prepared by its field as the ORM prepares it (`pre_save` where the field sets its
    own value, then `get_db_prep_save`). `returning`: the statement returns the new primary keys, in order."""
    built = _insert(model)
    if len(objs) == 1:
        return Statement(built.sql_one + built.keys if returning else built.sql_one, built.row(objs[0]))
    return Statement(built.sql + built.keys if returning else built.sql, built.values(objs))


def children_insert_statement(
    model: type[Model], children: Sequence[tuple[int, Model]], *, parent: str, source: str
) -> Statement:
    """PostgreSQL: insert child rows of parents that the same statement inserts: `source` names a
    CTE of it that returns the parents' ids in insert order (`INSERT ... RETURNING id`), and each
    child comes with the position of its parent among them (1-based); its `parent` foreign key is
    set from there. One array per column, as `insert_statement`; the SQL built once per model,
    parent and source (a submit's events: about a tenth of a one-by-one submit when rebuilt)."""
    one = len(children) == 1
    sql, fields = _children_insert(model, parent=parent, source=source, one=one)
    real = default_connection()
    if one:
        ((position, obj),) = children
        return Statement(sql, [position, *(f.get_db_prep_save(f.pre_save(obj, True), real) for f in fields)])
    params: list[Any] = [[position for position, _ in children]]
    params += [[f.get_db_prep_save(f.pre_save(obj, True), real) for _, obj in children] for f in fields]
    return Statement(sql, params)


_CHILDREN: dict[tuple[type[Model], str, str, str, bool], tuple[str, list[Field[Any, Any]]]] = {}


def _children_insert(model: type[Model], *, parent: str, source: str, one: bool) -> tuple[str, list[Field[Any, Any]]]:
    """The SQL of `children_insert_statement`; `one` child: its values as scalars (arrays cost
    psycopg a dump each and the server an UNNEST: the one event of a one-by-one submit)."""
    key = (model, parent, source, connection.vendor, one)
    built = _CHILDREN.get(key)
    if built is None:
        qn = connection.ops.quote_name
        link = _field(model, parent)
        fields = [f for f in model._meta.concrete_fields if not f.primary_key and not f.generated and f is not link]
        suffix = "" if one else "[]"
        typed = ", ".join(["%s::bigint" + suffix, *(f"%s::{f.db_type(connection)}{suffix}" for f in fields)])
        names = [f"c{i}" for i in range(len(fields))]
        columns = ", ".join(qn(str(f.column)) for f in [link, *fields])
        rows = f"(SELECT {typed})" if one else f"UNNEST({typed})"
        sql = (
            f"INSERT INTO {qn(model._meta.db_table)} ({columns}) "
            f"SELECT p.id, {', '.join(f'c.{n}' for n in names)} "
            f"FROM (SELECT id, row_number() OVER (ORDER BY id) AS ord FROM {source}) AS p "
            f"JOIN {rows} AS c(ord, {', '.join(names)}) ON c.ord = p.ord"
        )
        built = _CHILDREN[key] = (sql, fields)
    return built


def rows_insert(model: type[Model], objs: Sequence[Model], *, riders: Riders = NO_RIDERS) -> None:
    """Insert the unsaved `objs` in one statement and give each its primary key, as bulk_create
    does: `insert_statement` on PostgreSQL (with the riders), bulk_create elsewhere (then the
    riders' `instead`)."""
    if not objs:
        return
    if not riding_supported():
        model._default_manager.bulk_create(objs)
        if riders.instead is not None:
            riders.instead()
        return
    keys = sent_rows(insert_statement(model, objs, returning=True), riders, list)()
    rows_stored(objs, [pk for pk, *_ in keys], using=connection.alias)


def delete_sent(
    model: type[Model], *, field: str, values: Sequence[Any], returning: Sequence[str], riders: Riders = NO_RIDERS
) -> Callable[[], list[tuple[Any, ...]]]:
    """Delete the rows whose `field` is one of `values` (DELETE ... RETURNING, PostgreSQL and
    SQLite 3.35+), executed now; calling the result reads the returned fields of each deleted row,
    converted (`returned`), so inside telemachus.db.pipeline.together() the DELETE goes with the
    block's other statements. With `riders`, `returning` must not be empty."""
    qn = connection.ops.quote_name
    columns = ", ".join(qn(str(_field(model, name).column)) for name in returning)
    sql = (
        f"DELETE FROM {qn(model._meta.db_table)} WHERE {qn(str(_field(model, field).column))} "
        f"IN ({', '.join(['%s'] * len(values))}) RETURNING {columns}"
    )
    return sent_rows(Statement(sql, list(values)), riders, lambda rows: returned(model, returning, rows))


def upsert_add(
    model: type[Model],
    rows: Mapping[Any, Sequence[Any]],
    *,
    keys: Sequence[str],
    adds: Sequence[str],
    first: Sequence[str] = (),
    returning: Sequence[str] = (),
) -> list[tuple[Any, ...]]:
    """Add to counter rows, creating them as needed: for each key (a tuple of the values of
    `keys`, a unique constraint of the model), the values of `first` (written when the row is
    created, left as they are after) then those of `adds` (added), in one statement (INSERT ...
    ON CONFLICT DO UPDATE SET f = f + excluded.f), rows in key order so concurrent writers lock
    them in the same order. The ledgers' write (quotas/budget.py). `returning`: fields of each
    row as it stands after the addition, converted as the ORM converts them (RETURNING,
    PostgreSQL and SQLite 3.35+)."""
    if not rows:
        return []
    fields = [_field(model, name) for name in [*keys, *first, *adds]]
    qn = connection.ops.quote_name
    table = qn(model._meta.db_table)
    columns = [qn(str(field.column)) for field in fields]
    params: list[Any] = []
    real = default_connection()
    for key, values in sorted(rows.items()):
        row = [*key, *values]
        params += [field.get_db_prep_save(value, real) for field, value in zip(fields, row, strict=True)]
    placeholders = ", ".join(["(" + ", ".join(["%s"] * len(fields)) + ")"] * len(rows))
    increments = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in columns[len(keys) + len(first) :])
    sql = (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES {placeholders} "
        f"ON CONFLICT ({', '.join(columns[: len(keys)])}) DO UPDATE SET {increments}"
    )
    if not returning:
        Statement(sql, params).run()
        return []
    back = ", ".join(f"{table}.{qn(str(_field(model, name).column))}" for name in returning)
    return returned(model, returning, Statement(f"{sql} RETURNING {back}", params).rows())


def upsert_decayed(
    model: type[Model],
    charges: Mapping[Any, float],
    *,
    key: str,
    value: str,
    stamp: str,
    now: Any,
    half_life: float,
) -> None:
    """Add to exponentially decayed accumulators (usage that halves every `half_life` seconds,
    stored as of `stamp`), creating rows as needed: one statement that reads, decays to `now`,
    adds and creates (INSERT ... ON CONFLICT DO UPDATE), locking the rows in key order. A charge
    may be negative; the value never goes below 0. Fair share's usage (scheduler/services/shares.py)."""
    if not charges:
        return
    qn = connection.ops.quote_name
    key_field, value_field, stamp_field = _field(model, key), _field(model, value), _field(model, stamp)
    table = qn(model._meta.db_table)
    k, usage, updated = qn(str(key_field.column)), qn(str(value_field.column)), qn(str(stamp_field.column))
    if connection.vendor == "postgresql":
        greatest = "GREATEST"
        elapsed = f"EXTRACT(EPOCH FROM (excluded.{updated} - {table}.{updated}))"
    else:
        greatest = "MAX"
        elapsed = f"(julianday(excluded.{updated}) - julianday({table}.{updated})) * 86400.0"
    row = f"({_cast(key_field)}, {_cast(value_field)})"
    decayed = f"{table}.{usage} * POWER(0.5, {greatest}({elapsed}, 0) / %s)" if half_life > 0 else "0.0"
    # A new row holds the charge (never below 0); a present one its decayed value plus the charge.
    # (`WHERE true` tells SQLite's parser that ON CONFLICT is the upsert's, not a join's.)
    sql = (
        f"WITH v(k, charge) AS (VALUES {', '.join([row] * len(charges))}) "
        f"INSERT INTO {table} ({k}, {usage}, {updated}) "
        f"SELECT k, {greatest}(charge, 0.0), %s FROM v WHERE true ORDER BY k "
        f"ON CONFLICT ({k}) DO UPDATE SET "
        f"{usage} = {greatest}({decayed} + (SELECT charge FROM v WHERE v.k = excluded.{k}), 0.0), "
        f"{updated} = {greatest}(excluded.{updated}, {table}.{updated})"
    )
    params: list[Any] = [item for pair in sorted(charges.items()) for item in pair]
    params.append(stamp_field.get_db_prep_save(now, connection))
    if half_life > 0:
        params.append(half_life)
    Statement(sql, params).run()


def rows_copy(model: type[Model], fields: Sequence[str], rows: Iterable[Sequence[Any]]) -> int:
    """Append many rows of `fields` at once (their keys are not read back): PostgreSQL's COPY,
    about twelve times the rows per second of a multi-row INSERT for a batch's lines, with each
    value prepared by its field as the ORM prepares it (JSON as its text); bulk_create elsewhere.
    Inside the caller's transaction. How many rows were written."""
    columns = [_field(model, name) for name in fields]
    if connection.vendor != "postgresql":
        objs = [model(**dict(zip(fields, row, strict=True))) for row in rows]
        model._default_manager.bulk_create(objs)
        return len(objs)
    qn = connection.ops.quote_name
    sql = f"COPY {qn(model._meta.db_table)} ({', '.join(qn(str(f.column)) for f in columns)}) FROM STDIN"
    written = 0
    with connection.cursor() as cursor, cursor.cursor.copy(sql) as copy:
        for row in rows:
            copy.write_row([_copied(field, value) for field, value in zip(columns, row, strict=True)])
            written += 1
    return written


def _copied(field: "Field[Any, Any]", value: Any) -> Any:
    if value is None:
        return None
    if isinstance(field, JSONField):
        return json.dumps(value, cls=field.encoder)
    return field.get_db_prep_save(value, connection)
