"""One way to write what a model's transitions changed.

A transition (a job's start, end, retry, return to the queue) is a method of the model: it checks
where the row stands, sets the fields the move changes and records their names. `rows_save`
writes exactly those fields of many instances in as few statements as there are distinct sets of
changed fields (one, when every instance went through the same transition), through
`update_statement` (telemachus/db/bulk.py). So the SQL that stores a move is derived from the
Python that makes it: the two cannot disagree, and no caller lists fields by hand."""

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache, partial
from typing import Any, TypeVar

from django.db.models import Field, Model

from telemachus.db.bulk import returned, update_statement
from telemachus.db.locks import Level
from telemachus.db.statements import NO_RIDERS, Riders, riders_send, send, sent_rows

M = TypeVar("M", bound=Model)


class TrackedChanges:
    """Mixin for a model whose transitions record the fields they change."""

    def fields_changed(self, *names: str) -> None:
        """Record that these fields changed (in the order first changed)."""
        changes: dict[str, None] = self.__dict__.setdefault("_changed_fields", {})
        for name in names:
            changes[name] = None

    def changed(self) -> tuple[str, ...]:
        """The fields changed since the instance was read or last written."""
        return tuple(self.__dict__.get("_changed_fields", ()))

    def changes_written(self) -> None:
        self.__dict__.pop("_changed_fields", None)


@lru_cache(maxsize=256)
def _attnames(model: type[Model], names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """Each field's name and the attribute holding its value (a foreign key's id)."""
    found = []
    for name in names:
        field = model._meta.get_field(name)
        assert isinstance(field, Field), f"{model.__name__}.{name} is not a column"
        found.append((name, field.attname))
    return tuple(found)


def _row(obj: Model, names: tuple[str, ...]) -> dict[str, Any]:
    """The instance's fields `names` as update_statement writes them (a foreign key as its id)."""
    values = obj.__dict__
    row: dict[str, Any] = {"id": obj.pk}
    for name, attname in _attnames(type(obj), names):
        row[name] = values[attname] if attname in values else getattr(obj, attname)
    return row


def rows_save(
    objs: Sequence[Model],
    *,
    riders: Riders = NO_RIDERS,
    where: Mapping[str, Any] | None = None,
    expect: Sequence[Mapping[str, Any]] = (),
    lock: Level | None = None,
    returning: Sequence[str] = (),
) -> Callable[[], list[tuple[Any, ...]]]:
    """Write the changed fields of `objs` (TrackedChanges), one statement per distinct set of
    changed fields, executed now (inside telemachus.db.pipeline.together() they go with the block's
    other statements); calling the result reads what the statements returned.

    `where`, `expect` (one mapping per instance) and `lock` are update_statement's: rows that no
    longer meet them are not written (the caller reads which were from `returning`, whose first
    field is the key). `riders` go with the first statement, which then returns its rows' keys."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, obj in enumerate(objs):
        assert isinstance(obj, TrackedChanges)
        changed = obj.changed()
        if changed:
            groups.setdefault(changed, []).append(i)
    reads = []
    for names, indexes in groups.items():
        group = [objs[i] for i in indexes]
        model = type(group[0])
        wanted = list(returning) or (["id"] if riders else [])
        statement = update_statement(
            model,
            [_row(obj, names) for obj in group],
            where=where,
            expect=[expect[i] for i in indexes] if expect else (),
            lock=lock,
            returning=wanted,
        )
        if wanted:
            reads.append(sent_rows(statement, riders, partial(returned, model, wanted)))
        else:
            send(statement, riders)
        riders = NO_RIDERS
        for obj in group:
            obj.changes_written()  # type: ignore[attr-defined]

    if riders:
        riders_send(riders)

    def read() -> list[tuple[Any, ...]]:
        return [row for each in reads for row in each()]

    return read
