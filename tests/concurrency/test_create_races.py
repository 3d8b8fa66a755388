"""Identical creates at the same moment, on PostgreSQL: the loser gets the answer a later duplicate
gets (400 naming the field, in the API's error shape), never a 500 from the unique constraint.

Each race is made certain rather than hoped for: a thread runs the same create in a transaction
of its own connection and keeps it open; the request then passes its "does it exist?" check (the
row is not committed yet) and its INSERT waits on the unique index; once PostgreSQL shows it
waiting, the thread commits, and the request's INSERT fails as a real race's would."""

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import connection, transaction

from executors.models import Executor
from executors.services import executor_create
from quotas.models import QuotaPolicy
from quotas.services import quota_policy_create
from telemachus.control.features import feature_set
from telemachus.models import FeatureSwitch, Team
from telemachus.teams.services import team_create
from telemachus.teams.users import user_create

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _conninfo() -> str:
    s = connection.settings_dict
    password = f" password={s['PASSWORD']}" if s.get("PASSWORD") else ""
    return (
        f"host={s.get('HOST') or '127.0.0.1'} port={s.get('PORT') or 5432} dbname={s['NAME']} "
        f"user={s.get('USER') or 'postgres'}{password}"
    )


@contextmanager
def created_meanwhile(create: Callable[[], object]) -> Iterator[threading.Event]:
    """Run `create` in another connection's open transaction; commit it as soon as some other
    connection of the test database waits on a lock (the request's INSERT on the unique index).
    Yields an event that is set if a waiter was seen."""
    ready, release, seen = threading.Event(), threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def hold() -> None:
        try:
            with transaction.atomic():
                create()
                ready.set()
                release.wait(20)
        except BaseException as exc:  # reported in the test's thread
            failure.append(exc)
            ready.set()
        finally:
            connection.close()

    def watch() -> None:
        deadline = time.monotonic() + 15
        # Never prepared: behind PgBouncer (.ci/run) each poll may run on another server connection.
        with psycopg.connect(_conninfo(), autocommit=True, prepare_threshold=None) as conn:
            while time.monotonic() < deadline and not release.is_set():
                waiting = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                ).fetchone()[0]
                if waiting:
                    seen.set()
                    break
                time.sleep(0.02)
        release.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert ready.wait(20)
    if failure:
        raise failure[0]
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield seen
    finally:
        release.set()
        watcher.join(20)
        holder.join(20)


def test_users(api, operator):
    with created_meanwhile(lambda: user_create(username="carol", by=None)) as raced:
        response = api(operator).post("/api/users/", {"username": "carol"}, format="json")
    assert raced.is_set()
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "validation_error" and "carol" in response.json()["fields"]["username"][0]
    assert list(type(operator).objects.filter(username="carol").values_list("username", flat=True)) == ["carol"]


def test_teams(api, operator):
    with created_meanwhile(lambda: team_create(slug="lab", name="Lab")) as raced:
        response = api(operator).post("/api/teams/", {"slug": "lab", "name": "Lab"}, format="json")
    assert raced.is_set()
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "validation_error" and "slug" in response.json()["fields"]
    assert Team.objects.filter(slug="lab").count() == 1


def test_executors(api, operator):
    fields = {"name": "gpu1", "kind": "sim", "capabilities": {"models": ["m"]}}
    with created_meanwhile(lambda: executor_create(**fields)) as raced:
        response = api(operator).post("/api/executors/", fields, format="json")
    assert raced.is_set()
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "validation_error" and "name" in response.json()["fields"]
    assert Executor.objects.filter(name="gpu1").count() == 1


def test_quota_rules(api, operator):
    rule = {"scope": "global", "subject": "", "dimension": "ai.tokens", "limit": 100, "window": "day"}
    with created_meanwhile(lambda: quota_policy_create(**rule)) as raced:
        response = api(operator).post("/api/quota-policies/", {**rule, "subject": None}, format="json")
    assert raced.is_set()
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "validation_error"
    assert QuotaPolicy.objects.count() == 1


def test_feature_switches(api, operator):
    # Setting a switch is idempotent: the second identical set finds the first's row and agrees.
    with created_meanwhile(lambda: feature_set(feature="chat", team=None, enabled=False, by=None)) as raced:
        response = api(operator).put("/api/features/", {"feature": "chat", "enabled": False}, format="json")
    assert raced.is_set()
    assert response.status_code == 200, response.content
    assert response.json()["global"]["chat"] is False
    assert list(FeatureSwitch.objects.values_list("feature", "team", "enabled")) == [("chat", None, False)]
