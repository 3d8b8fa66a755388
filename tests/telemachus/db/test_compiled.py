"""A query compiled once gives what the ORM gives, for any values and list lengths, and refuses
what it cannot compile rather than give other rows."""

from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from telemachus.control.config import version_annotation
from telemachus.db.compiled import CompiledQuery
from telemachus.db.locks import Level, rows_lock
from telemachus.db.pipeline import together
from telemachus.keys.models import ApiKey
from telemachus.models import Team

pytestmark = pytest.mark.django_db


def keys_of(names, live=True):
    return ApiKey.objects.select_related("principal", "team").filter(name__in=names, revoked_at__isnull=live)


def fields(key: ApiKey) -> tuple:
    return (
        key.pk,
        key.name,
        key.allowed_models,
        key.expires_at,
        key.team.slug,
        key.team.pk,
        key.principal.username,
        key.principal.is_active,
    )


@pytest.fixture
def keys(make_user, make_team):
    team = make_team("a")
    found = []
    for i, models in enumerate([[], ["m"], ["m", "e"]]):
        principal = make_user(f"key-principal-{i}")
        found.append(
            ApiKey.objects.create(
                team=team,
                name=f"k{i}",
                prefix=f"p{i}",
                digest=f"d{i}",
                allowed_models=models,
                principal=principal,
                expires_at=timezone.now() + timedelta(days=i) if i else None,
            )
        )
    return found


def test_rows_and_related_models_as_the_orm_gives_them(keys):
    query = CompiledQuery(lambda names: keys_of(names).order_by("pk"))
    for names in (["k0"], ["k2", "k1"], ["k0", "k1", "k2"], ["nope"], ["k1", "nope", "k2"]):
        compiled = [fields(key) for key in query(names=names)]
        assert compiled == [fields(key) for key in keys_of(names).order_by("pk")], names
    assert query(names=[]) == []


def test_queries_sent_together_read_what_each_would_alone(keys):
    # Given two compiled queries sent together (one round trip on PostgreSQL)...
    query = CompiledQuery(lambda names: keys_of(names).order_by("pk"))
    with transaction.atomic():
        with together():
            first, second, none = query.sent(names=["k0", "k2"]), query.sent(names=["k1"]), query.sent(names=[])
        # Then each reads, after the block, the rows it would give alone.
        assert [fields(key) for key in first()] == [fields(key) for key in query(names=["k0", "k2"])]
        assert [fields(key) for key in second()] == [fields(key) for key in query(names=["k1"])]
        assert none() == []


def test_the_sql_is_compiled_once_per_shape(keys):
    built = []

    def build(names):
        built.append(list(names))
        return keys_of(names)

    query = CompiledQuery(build)
    for names in (["k0"], ["k1"], ["k2"], ["k0", "k1"], ["k1", "k2"]):
        assert {key.name for key in query(names=names)} == set(names)
    assert len(built) == 2  # one list length, then the other
    with CaptureQueriesContext(connection) as run:
        query(names=["k2"])
    assert len(run) == 1


def test_scalar_values_and_constants_keep_their_places(keys):
    query = CompiledQuery(lambda team, name: ApiKey.objects.filter(team_id=team, name=name, principal__is_active=True))
    team = Team.objects.get(slug="a").pk
    assert [key.name for key in query(team=team, name="k1")] == ["k1"]
    assert query(team=team + 1000, name="k1") == []
    keys[1].principal.is_active = False
    keys[1].principal.save()
    assert query(team=team, name="k1") == []


def test_a_value_its_lookup_rewrites_is_refused(keys):
    query = CompiledQuery(lambda name: ApiKey.objects.filter(name__icontains=name))
    with pytest.raises(ValueError, match="rewritten"):
        query(name="k")


def test_annotations_deferred_fields_and_row_locks(keys):
    def build(ids):
        return (
            rows_lock(ApiKey.objects, level=Level.JOB, of=("self",))
            .filter(pk__in=ids)
            .annotate(db_now=Now(), config_version=version_annotation())
            .order_by("pk")
            .only("pk", "name", "team_id")
        )

    query = CompiledQuery(build)
    ids = [key.pk for key in keys[1:]]
    with transaction.atomic():
        compiled, orm = query(ids=ids), list(build(ids))
    assert [(k.pk, k.name, k.team_id, k.config_version) for k in compiled] == [
        (k.pk, k.name, k.team_id, k.config_version) for k in orm
    ]
    assert all(k.db_now is not None for k in compiled)
    assert (
        compiled[0].get_deferred_fields() == orm[0].get_deferred_fields() and "digest" in orm[0].get_deferred_fields()
    )
