"""The claim thread of an API process (scheduler/gateway/onehop.py) keeps its connection and does
not ping it before each claim; a connection the server ended since the last claim is found by the
claim itself, closed, and the claim made again on a new one, so the call is still claimed here."""

import pytest
from django.db import connection

from scheduler.connections import database_thread
from scheduler.gateway.onehop import _claim_call

pytestmark = pytest.mark.django_db(transaction=True)


def claim_thread_state(only: frozenset[int]) -> tuple[int, int, bool]:
    """Claim on the claim thread's connection: (jobs claimed, its server process, pinged)."""
    batch = _claim_call(worker="api:test", only=only, limit=len(only))
    return len(batch.claims), connection.connection.info.backend_pid, connection.health_check_enabled


def close_connection() -> None:
    connection.close()


def test_a_claim_on_a_connection_the_server_ended_reconnects_and_claims(member_setup, submit):
    if connection.vendor != "postgresql":
        pytest.skip("ends a PostgreSQL session")
    alice, _, a, _, _ = member_setup
    thread = database_thread("test-claim")
    try:
        # Given a call claimed on the claim thread's connection, which is not pinged before use...
        claimed, pid, pinged = thread.submit(claim_thread_state, frozenset({submit(alice, a).pk})).result()
        assert (claimed, pinged) == (1, False)
        # When the server ends that session (a restart, an administrator), and the next call comes...
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        claimed, new_pid, _ = thread.submit(claim_thread_state, frozenset({submit(alice, a).pk})).result()

        # Then it is claimed all the same, on a new connection.
        assert claimed == 1 and new_pid != pid
    finally:
        thread.submit(close_connection).result()
        thread.shutdown()
