"""telemachus/pipeline.py: statements sent to PostgreSQL together."""

import pytest
from django.db import DataError, connection, transaction

from telemachus.pipeline import together
from tests.roundtrips import round_trips

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.postgres
def test_the_blocks_statements_go_in_one_round_trip_and_run_in_order_in_the_transaction():
    # Given a transaction not yet begun on the server...
    rows = []

    def block():
        with transaction.atomic():
            with connection.cursor() as first, connection.cursor() as second, connection.cursor() as third:
                # When three statements are sent together (the second sees what the first did)...
                with together():
                    first.execute("CREATE TEMPORARY TABLE pipeline_probe (n int) ON COMMIT DROP")
                    second.execute("INSERT INTO pipeline_probe VALUES (1), (2) RETURNING n, txid_current()")
                    third.execute("SELECT count(*), txid_current() FROM pipeline_probe")
                rows.extend([second.fetchall(), third.fetchone()])

    # Then the three took one round trip (psycopg's BEGIN one before, the COMMIT one after), ran
    # in order, in one transaction.
    assert round_trips(block) == 3
    inserted, (count, txid) = rows
    assert [n for n, _ in inserted] == [1, 2] and count == 2
    assert {t for _, t in inserted} == {txid}


@pytest.mark.postgres
def test_an_error_in_the_block_is_djangos_and_the_transaction_rolls_back():
    # Given a statement that fails among others sent together...
    with pytest.raises(DataError):
        with transaction.atomic():
            with connection.cursor() as first, connection.cursor() as second:
                with together():
                    first.execute("SELECT 1")
                    second.execute("SELECT 1 / 0")
    # Then it is raised as Django's error (what callers catch), and the connection goes on.
    with connection.cursor() as cursor:
        cursor.execute("SELECT 2")
        assert cursor.fetchone() == (2,)


def test_elsewhere_the_statements_run_as_they_come():
    with transaction.atomic(), connection.cursor() as cursor:
        with together():
            cursor.execute("SELECT 3")
            # A fetch inside the block works everywhere; on PostgreSQL it costs a round trip.
            assert cursor.fetchone() == (3,)
