"""The configuration version moves with every configuration write, whoever makes it, and wakes the
workers on PostgreSQL."""

from datetime import timedelta

import psycopg
import pytest
from django.contrib.auth.models import Group, Permission
from django.db import connection
from django.utils import timezone
from guardian.shortcuts import assign_perm, remove_perm

from executors.models import Executor
from quotas.models import QuotaPolicy
from scheduler.models import QueuePolicy
from telemachus.control.config import config_version
from telemachus.control.notify import CONFIG_CHANGED, WORKERS_CHANNEL
from telemachus.models import ConfigVersion, Membership
from telemachus.teams.services import team_member_set

pytestmark = pytest.mark.django_db

# Executor columns that change with the work, not with configuration (see the triggers' migration).
RUNTIME = {"last_seen": timezone.now(), "last_probed_at": timezone.now(), "consecutive_failures": 3}
CONFIGURED = {
    "team": "a team",
    "kind": "local-model",
    "name": "renamed",
    "endpoint": "http://127.0.0.1:1/v1",
    "capabilities": {"models": ["x"]},
    "max_concurrency": 9,
    "enabled": False,
    "health": "down",
    "weight": 5,
    "transport": {"timeout": 3},
    "meta": {"k": 1},
    "prices": {"x": {"input": "1", "output": "2"}},
    "breaker": "open",
    "breaker_until": timezone.now() + timedelta(seconds=5),
}


def bumps(change) -> bool:
    before = config_version()
    change()
    return config_version() > before


class TestWhatBumps:
    def test_every_configuration_table(self, member_setup, make_user, make_team):
        alice, bob, team_a, _, executor = member_setup
        carol = make_user("carol")
        perm = Permission.objects.get(codename="use_chat")
        group = Group.objects.create(name="g")
        writes = {
            "team": lambda: make_team("c"),
            "membership": lambda: team_member_set(team=team_a, username="carol", role="member"),
            "membership role": lambda: Membership.objects.filter(user=carol).update(role="manager"),
            "user renamed": lambda: type(carol).objects.filter(pk=carol.pk).update(username="caroline"),
            "user deactivated": lambda: type(carol).objects.filter(pk=carol.pk).update(is_active=False),
            "user's groups": lambda: carol.groups.add(group),
            "user's permissions": lambda: carol.user_permissions.add(perm),
            "group's permissions": lambda: group.permissions.add(perm),
            "object permission to a user": lambda: assign_perm("telemachus.run_flows", carol, team_a),
            "object permission to a group": lambda: remove_perm("telemachus.use_chat", team_a.group, team_a),
            "executor created": lambda: Executor.objects.create(name="e2", kind="sim"),
            "quota rule": lambda: QuotaPolicy.objects.create(scope="global", dimension="ai.concurrency", limit=3),
            "quota rule raised": lambda: QuotaPolicy.objects.update(limit=4),
            "quota rule deleted": lambda: QuotaPolicy.objects.all().delete(),
            "queue policy": lambda: QueuePolicy.objects.update_or_create(pk=1, defaults={"max_attempts": 5}),
            "executor deleted": lambda: Executor.objects.filter(name="e2").delete(),
        }
        assert {what: bumps(write) for what, write in writes.items()} == dict.fromkeys(writes, True)

    @pytest.mark.parametrize("field", sorted(CONFIGURED))
    def test_each_configured_executor_column(self, member_setup, field):
        team_a, executor = member_setup[2], member_setup[4]
        value = team_a if field == "team" else CONFIGURED[field]
        assert bumps(lambda: Executor.objects.filter(pk=executor.pk).update(**{field: value}))

    def test_not_what_changes_with_the_work(self, member_setup, make_user):
        alice, executor = member_setup[0], member_setup[4]
        assert not bumps(lambda: Executor.objects.filter(pk=executor.pk).update(**RUNTIME))
        assert not bumps(lambda: type(alice).objects.filter(pk=alice.pk).update(last_login=timezone.now()))

    def test_every_executor_column_is_accounted_for(self):
        # A new Executor column must be sorted into one of the two lists (and watched by a
        # migration if placement reads it), or this fails.
        columns = {f.name for f in Executor._meta.concrete_fields} - {"id", "created_at", "updated_at"}
        assert columns == set(CONFIGURED) | set(RUNTIME)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_configuration_write_wakes_listeners_when_it_commits(member_setup):
    # Given a connection listening on the workers' channel...
    s = connection.settings_dict
    with psycopg.connect(
        host=s["HOST"] or "127.0.0.1", port=s["PORT"] or 5432, user=s["USER"], dbname=s["NAME"], autocommit=True
    ) as listener:
        listener.execute(f"LISTEN {WORKERS_CHANNEL}")

        # When an operator raises an executor's capacity with a plain UPDATE...
        Executor.objects.filter(name="shared").update(max_concurrency=8)

        # Then the listener hears that configuration changed.
        notes = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert notes == [CONFIG_CHANGED]


def test_a_recreated_version_row_does_not_repeat_old_versions(make_team):
    # Given a version some process may have cached...
    make_team("first")
    cached = config_version()
    # When the row is lost (a flushed test database, a restored backup) and configuration changes...
    ConfigVersion.objects.all().delete()
    make_team("second")
    # Then the new row starts from the clock, far from any version counted before.
    assert config_version() > cached
