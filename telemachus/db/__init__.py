"""The database mechanics, and the one place SQL is written (docs/architecture.md, "Where SQL lives").

    locks.py       every row lock, in the project's one lock order
    pipeline.py    statements sent to PostgreSQL together: one round trip for several
    statements.py  statements as values; riders (events, NOTIFYs) sent as CTEs of another statement
    notify.py      NOTIFY and LISTEN
    bulk.py        many rows per statement: per-row UPDATEs, INSERTs, DELETEs, counter upserts
    changes.py     writing what a model's transitions changed (`rows_save`)
    compiled.py    hot ORM queries compiled once
    constants.py   constants in a statement's text, so partial indexes serve its one plan
    rows.py        the one row mapper: driver rows into instances or converted values
    snapshots.py   reads that must agree (one snapshot), and a ping
    triggers.py    version counters bumped by triggers (the configuration version)
    timestamps.py  psycopg's C timestamp loader in place of Django's Python one
    internals.py   every use of Django's private internals, pinned by tests

Nothing here knows the apps: builders take the models they write as arguments. Outside this
package SQL is written only in the migrations and the exceptions tests/test_raw_sql.py names."""
