"""Which database errors the worker retries as an outage (a new connection may succeed) and which
it treats as refused data. The pooler case is exercised for real by the fifty-cuts fault test run
through PgBouncer (.ci/run); this pins the classification."""

import pytest
from django.db import DataError, IntegrityError, InterfaceError, InternalError, OperationalError

from scheduler.connections import database_outage, worker_database_settings


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


POSTGRES = {"ENGINE": "django.db.backends.postgresql", "NAME": "t", "OPTIONS": {"pool": True}}


def test_a_workers_session_bound_goes_to_postgresql_directly(settings):
    settings.TELEMACHUS_PGBOUNCER, settings.TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS = False, 15
    assert worker_database_settings(POSTGRES)["OPTIONS"] == {"options": "-c idle_in_transaction_session_timeout=15000"}


def test_behind_a_pooler_it_sends_none(settings):
    # PgBouncer refuses the options startup parameter (or drops it when told to ignore it): the
    # pooler's idle_transaction_timeout is the bound there (bin/pgbouncer-test).
    settings.TELEMACHUS_PGBOUNCER, settings.TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS = True, 15
    shown = worker_database_settings(POSTGRES)
    assert shown["OPTIONS"] == {} and shown["CONN_MAX_AGE"] is None


def test_a_workers_connection_is_checked_on_error_not_pinged_before_each_use(settings):
    # Its loop retries a call that found it broken, on a new connection (tests/concurrency/test_faults.py).
    assert worker_database_settings(POSTGRES)["CONN_HEALTH_CHECKS"] is False
