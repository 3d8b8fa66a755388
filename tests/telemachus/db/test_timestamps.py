"""Timestamps read with psycopg's C loader are the values, and the tzinfo, Django's own loader gives."""

import datetime

import pytest
from django.db import connection
from django.db.backends.postgresql.psycopg_any import register_tzloader

from scheduler.models import Job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

UTC = datetime.UTC
# Around the edges of the text format: microseconds, offsets with minutes and seconds, dates before
# 1900 and at the end of the range, a leap day, and a timestamp given without an offset.
TEXTS = [
    "2024-02-29 23:59:59.123456+05:30",
    "1900-01-01 00:00:00-00:19:32",
    "0001-01-01 00:00:00+00",
    "9999-12-31 23:59:59.999999+00",
    "2026-12-05 12:00:00",
    "1970-01-01 00:00:00.000001-12",
]


def select(texts: list[str]) -> str:
    return "SELECT " + ", ".join(f"%s::timestamptz AS t{i}" for i in range(len(texts)))


def read(loader_from_django: bool, texts: list[str] = TEXTS) -> tuple:
    connection.ensure_connection()
    with connection.cursor() as cursor:
        if loader_from_django:
            register_tzloader(connection.timezone, cursor.cursor)
        cursor.execute(select(texts), texts)
        return cursor.fetchone()


def test_values_and_tzinfo_are_djangos():
    ours, djangos = read(False), read(True)
    assert ours == djangos
    assert all(value.tzinfo is UTC for value in ours)


def test_the_connections_loader_is_the_c_one():
    connection.ensure_connection()
    loader = connection.connection.adapters.get_loader(connection.connection.adapters.types["timestamptz"].oid, 0)
    assert loader.__name__ == "UtcTimestamptzLoader"
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        made = cursor.cursor._tx.get_loader(connection.connection.adapters.types["timestamptz"].oid, 0)
    # The row maker calls the C loader's own method: no Python frame of ours per value.
    assert type(made.load.__self__).__module__.endswith("_psycopg")


def test_a_session_in_another_time_zone_still_reads_utc():
    # Given a session whose TimeZone someone changed (Django sets UTC at connect)... (Year 9999's
    # last day is past year 10,000 in Kathmandu, which no loader can read; a text without an
    # offset is another instant there.)
    texts = [text for text in TEXTS if not text.startswith(("9999", "2026"))]
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'Asia/Kathmandu'")
        try:
            cursor.execute(select(texts), texts)
            ours = cursor.fetchone()
        finally:
            cursor.execute("SET TIME ZONE 'UTC'")
    # Then the values are the same instants, in UTC, as Django's loader gives in UTC.
    assert ours == read(True, texts)
    assert all(value.tzinfo is UTC for value in ours)


def test_models_read_through_it(make_user, make_team):
    team, user = make_team("a"), make_user("alice")
    job = Job.objects.create(team=team, user=user, type=Job.Type.CHAT, requirements={}, input={})
    read_back = Job.objects.get(pk=job.pk)
    assert read_back.submitted_at == job.submitted_at
    assert read_back.submitted_at.tzinfo is UTC


def test_an_instant_with_no_utc_date_in_such_a_session_is_read_as_the_server_gives_it():
    # Given a session five hours east of Greenwich, and the first instant of year 1 there (year 0
    # in UTC)...
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE INTERVAL '+05:00' HOUR TO MINUTE")
        try:
            cursor.execute("SELECT '0001-01-01 00:00:00+05'::timestamptz")
            [value] = cursor.fetchone()
        finally:
            cursor.execute("SET TIME ZONE 'UTC'")
    # Then it is read, in the session's offset, instead of failing.
    assert (value.year, value.utcoffset()) == (1, datetime.timedelta(hours=5))
