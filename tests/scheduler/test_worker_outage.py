"""Which database errors the worker retries as an outage (a new connection may succeed) and which
it treats as refused data. The pooler case is exercised for real by the fifty-cuts fault test run
through PgBouncer (.ci/run); this pins the classification."""

import pytest
from django.db import DataError, IntegrityError, InterfaceError, InternalError, OperationalError

from scheduler.worker.runner import database_outage


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (OperationalError("terminating connection due to administrator command"), True),
        (InterfaceError("connection already closed"), True),
        # PgBouncer, a server connection terminated while idle in its pool: the FATAL error and the
        # next client's BEGIN (or COMMIT) answer together.
        (InternalError("received 2 results from command 'BEGIN'"), True),
        (InternalError("received 2 results from command 'COMMIT'"), True),
        (InternalError("could not serialize access"), False),
        (IntegrityError("duplicate key value violates unique constraint"), False),
        (DataError("unsupported Unicode escape sequence"), False),
    ],
)
def test_only_connection_failures_are_outages(error, outage):
    assert database_outage(error) is outage
