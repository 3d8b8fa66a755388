"""Migration operations that keep a busy database serving while they run.

An index built the plain way locks its table against writes until it is built: on a jobs table of
millions of rows that stops every submit and claim for as long. `AddIndexOnline` builds it
CONCURRENTLY on PostgreSQL (its migration must say `atomic = False`), and the plain way on SQLite,
which serializes writers anyway (docs/deploy.md, "Upgrades")."""

from typing import Any

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db.migrations.operations import AddIndex


class AddIndexOnline(AddIndexConcurrently):
    """AddIndex, CONCURRENTLY where the database can (PostgreSQL)."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_forwards(app_label, schema_editor, from_state, to_state)
        else:
            AddIndex.database_forwards(self, app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            super().database_backwards(app_label, schema_editor, from_state, to_state)
        else:
            AddIndex.database_backwards(self, app_label, schema_editor, from_state, to_state)
