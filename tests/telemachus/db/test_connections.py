"""telemachus/db/connections.py: a connection the server ended while idle is replaced before the
next statement, and an error from an ended session is known not to have applied the statement."""

import time

import pytest
from django.db import OperationalError, connection

from telemachus.db.connections import connection_refresh, statement_not_run
from tests.concurrency.sessions import postgres_session

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def terminate(pid: int) -> None:
    with postgres_session() as session:
        assert session.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]
    time.sleep(0.2)  # the server's goodbye reaches the client's socket


def test_a_connection_ended_while_idle_is_replaced_before_the_next_statement():
    # Given a connection the server ended while it sat idle...
    pid = backend_pid()
    terminate(pid)

    # When it is refreshed, the next statement runs, on a new session.
    connection_refresh()
    assert backend_pid() != pid


def test_a_healthy_connection_is_kept():
    pid = backend_pid()
    connection_refresh()
    assert connection.connection is not None
    assert backend_pid() == pid


def test_a_statement_on_an_ended_session_is_known_not_to_have_run():
    # Given a connection ended under it, not refreshed...
    terminate(backend_pid())

    # When a statement is sent on it, it fails, and the failure says the statement did not run.
    with pytest.raises(OperationalError) as failed:
        backend_pid()
    assert statement_not_run(failed.value)
    connection.close()


def test_a_refused_statement_is_not_taken_for_one_that_did_not_run():
    with pytest.raises(Exception) as failed:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1/0")
    assert not statement_not_run(failed.value)
