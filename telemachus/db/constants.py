"""Constants written into a statement's text instead of sent as parameters.

PostgreSQL plans a prepared statement once (its generic plan) only when that plan is as good as
planning each execution with the values in hand. A partial index whose predicate says
`status = 'queued'` serves a statement that says `status = 'queued'`, never one that says
`status = $1`: with the constant as a parameter every execution of a hot read of the queue is
planned anew, and planning a statement on the job table weighs every one of its twenty-odd
indexes. The claim's clock (four reads of partial indexes) spent about half a millisecond per
claim that way, its execution a twentieth of that. Django sends every value as a parameter under
server-side binding (settings: DATABASE_PREPARE), hence this expression."""

import re
from typing import Any

from django.db.models import CharField, Expression, Field

_SAFE = re.compile(r"[A-Za-z0-9_.:-]*")


class Constant(Expression):
    """A short text constant (a status, a type, the empty string) as a literal of the SQL.

    Only a code constant: the characters allowed cannot end the literal, so nothing a caller
    supplies could ever be spliced into the statement through it."""

    def __init__(self, value: str, output_field: Field[Any, Any] | None = None) -> None:
        if not _SAFE.fullmatch(value):
            raise ValueError(f"not a constant fit for a statement's text: {value!r}")
        super().__init__(output_field=output_field or CharField())
        self.value = value

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[str | int, ...]]:
        return f"'{self.value}'", ()
