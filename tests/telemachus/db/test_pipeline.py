"""telemachus/db/pipeline.py: statements sent to PostgreSQL together."""

import psycopg
import pytest
from django.db import DatabaseError, DataError, connection, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from scheduler.models import TeamShare
from telemachus.db.pipeline import committing, together
from telemachus.teams.services import team_create
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


def _shares_elsewhere() -> int:
    """Team shares as another connection sees them: what is committed."""
    if connection.vendor != "postgresql":
        return TeamShare.objects.count()
    with psycopg.connect(**connection.get_connection_params()) as other:
        return other.execute("SELECT count(*) FROM scheduler_teamshare").fetchone()[0]


@pytest.fixture
def team():
    return team_create(slug="pipeline", name="pipeline")


@pytest.mark.postgres
def test_the_last_writes_and_the_commit_go_in_one_round_trip(team):
    committed = []

    def block():
        with transaction.atomic(durable=True):
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
            transaction.on_commit(lambda: committed.append(_shares_elsewhere()))
            # When the last write is sent with the COMMIT...
            with committing():
                TeamShare.objects.bulk_create([TeamShare(team=team, usage=1.0, updated_at=timezone.now())])

    # Then BEGIN, the read, and the write with the COMMIT took three round trips (four without
    # it), the row is committed, and on_commit hooks ran after the commit.
    assert round_trips(block) == 3
    assert _shares_elsewhere() == 1
    assert committed == [1]


def test_an_error_in_the_block_commits_nothing(team):
    with pytest.raises(DatabaseError):
        with transaction.atomic(durable=True):
            TeamShare.objects.create(team=team, usage=1.0, updated_at=timezone.now())
            with committing(), connection.cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table")
    assert _shares_elsewhere() == 0


def test_a_transaction_marked_for_rollback_commits_nothing(team):
    with transaction.atomic(durable=True):
        TeamShare.objects.create(team=team, usage=1.0, updated_at=timezone.now())
        transaction.set_rollback(True)  # as a caller does that swallows an inner failure
        with committing():
            pass
    assert _shares_elsewhere() == 0


def test_only_a_durable_block_can_be_ended():
    with pytest.raises(TransactionManagementError), committing():
        pass
    with pytest.raises(TransactionManagementError), transaction.atomic(), committing():
        pass


@pytest.mark.postgres
@pytest.mark.django_db(transaction=False)
def test_inside_a_test_cases_transaction_nothing_is_committed(team):
    with transaction.atomic(durable=True):
        with committing():
            TeamShare.objects.create(team=team, usage=1.0, updated_at=timezone.now())
    assert TeamShare.objects.count() == 1
    assert _shares_elsewhere() == 0
