"""What telemachus/db/internals.py relies on in Django's private internals, pinned against the Django
installed: a Django upgrade that moves any of it fails here, by name, before the hot paths read
rows wrong. (The timestamp loader's attribute is pinned in test_timestamps.py.)"""

import inspect

import django
import pytest
from django.db import connection, transaction
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from django.db.models import Count
from django.db.models.query import ModelIterable, get_related_populators
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from scheduler.models import Job, Slot
from telemachus.db.internals import (
    atomic_in_test_case,
    atomic_outermost_durable,
    compiled_rows,
    gives_instances,
    instance_saved,
    rollback_pending,
    sqlite_datetime,
    wrapped_cursor,
)
from telemachus.keys.models import ApiKey
from telemachus.models import Team

pytestmark = pytest.mark.django_db


def test_the_django_this_was_pinned_against():
    # 5.2 LTS and 6.0, as pyproject.toml allows; a new minor version: read internals.py again.
    assert django.VERSION[:2] in {(5, 2), (6, 0)}, django.get_version()


def test_a_compilers_recipe_of_model_rows():
    compiler = ApiKey.objects.select_related("team").only("name", "team__slug").query.get_compiler("default")
    compiler.as_sql()
    assert {"model", "select_fields"} <= set(compiler.klass_info)
    assert {"id", "name", "team_id"} <= {column[0].target.attname for column in compiler.select}
    assert isinstance(compiler.annotation_col_map, dict)
    assert callable(compiler.get_converters) and callable(compiler.apply_converters)
    assert list(inspect.signature(get_related_populators).parameters)[:3] == ["klass_info", "select", "db"]
    recipe = compiled_rows(compiler, "default")
    assert recipe.model is ApiKey and {"id", "name", "team_id"} <= set(recipe.attnames) and len(recipe.related) == 1


def test_a_recipe_of_columns_only(make_team):
    compiler = Job.objects.only("id", "input").query.get_compiler("default")
    recipe = compiled_rows(compiler, "default", setup=True)
    assert [target.attname for target in recipe.targets()] == ["id", "input"]
    # JSON is converted (parsed) by the column's converter, as the ORM does it.
    assert list(recipe.converted([(1, '{"a": 1}')]))[0][1] == {"a": 1}


def test_which_querysets_give_instances():
    assert gives_instances(Slot.objects.all())
    assert Slot.objects.all()._iterable_class is ModelIterable
    assert not gives_instances(Slot.objects.values_list("job_id").annotate(n=Count("*")))
    assert not gives_instances(Slot.objects.values("job_id"))


def test_an_instance_marked_stored():
    team = Team(slug="pinned", name="p")
    assert team._state.adding and team._state.db is None
    instance_saved(team, "default")
    assert not team._state.adding and team._state.db == "default"


def test_atomic_blocks_as_the_pipeline_reads_them():
    # Inside pytest-django's test case, whose block is marked as the test case's.
    assert atomic_in_test_case(connection)
    assert not atomic_outermost_durable(connection)
    with transaction.atomic():
        assert not atomic_outermost_durable(connection)  # not durable
        assert not rollback_pending(connection)
    assert all(hasattr(block, "durable") for block in connection.atomic_blocks)


@pytest.mark.django_db(transaction=True)
def test_a_durable_block_is_seen_as_the_outermost():
    assert not atomic_in_test_case(connection)
    with transaction.atomic(durable=True):
        assert atomic_outermost_durable(connection)
        with transaction.atomic():
            assert not atomic_outermost_durable(connection)


def test_our_own_cursor_goes_through_djangos_wrappers():
    connection.ensure_connection()
    with CaptureQueriesContext(connection) as captured:
        with wrapped_cursor("default", connection.connection.cursor()) as cursor:
            assert isinstance(cursor, CursorDebugWrapper | CursorWrapper)
            cursor.execute("SELECT 1")
    assert [q["sql"] for q in captured.captured_queries] == ["SELECT 1"]


def test_sqlite_text_timestamps_read_as_the_orm_reads_them():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's operations")
    now = timezone.now().replace(microsecond=123000)
    assert sqlite_datetime(now.strftime("%Y-%m-%d %H:%M:%S.%f"), connection) == now


def test_psycopg_keeps_the_conversion_of_a_long_query_with_many_parameters():
    """psycopg's query cache limits are module globals read at each execute; the app widens them
    (telemachus/apps.py), so the submit's statement is converted once, not at every submit."""
    from psycopg import _queries

    assert _queries.MAX_CACHED_STATEMENT_LENGTH >= 32_768 and _queries.MAX_CACHED_STATEMENT_PARAMS >= 256
    query = ("SELECT " + ", ".join(["%s::int"] * 80) + " -- " + "x" * 5000).encode()
    _queries._query2pg.cache_clear()
    for _ in range(3):
        _queries.PostgresQuery(transformer=_transformer()).convert(query, list(range(80)))
    assert _queries._query2pg.cache_info().hits == 2


def _transformer():
    from psycopg.adapt import Transformer

    return Transformer()
