"""Behind PgBouncer in transaction pooling (TELEMACHUS_PGBOUNCER=1) the settings turn off what
needs a server session: server-side cursors and prepared statements; LISTEN gets a URL of its own.
Read from a fresh process, as a deployment reads them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

from telemachus.control.notify import listen_connection_params, notify_connection_params

ROOT = Path(__file__).resolve().parents[2]
SHOW = (
    "import json, django; from django.conf import settings; django.setup(); "
    "d = settings.DATABASES['default']; "
    "print(json.dumps({'cursors': d.get('DISABLE_SERVER_SIDE_CURSORS', False), "
    "'options': {k: v for k, v in d['OPTIONS'].items() if k != 'pool'}, "
    "'listen': settings.TELEMACHUS_LISTEN_DATABASE_URL}))"
)


def settings_with(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TELEMACHUS_", "DATABASE_"))}
    result = subprocess.run(
        [sys.executable, "-c", SHOW],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**environ, "DJANGO_SETTINGS_MODULE": "telemachus.settings", **env},
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout)


def test_behind_pgbouncer_nothing_outlives_a_transaction():
    shown = settings_with(
        DATABASE_URL="postgres://app@127.0.0.1:6432/telemachus",
        TELEMACHUS_PGBOUNCER="1",
        TELEMACHUS_LISTEN_DATABASE_URL="postgres://app@127.0.0.1:5432/telemachus",
    )
    assert shown["cursors"] is True
    assert "prepare_threshold" in shown["options"] and shown["options"]["prepare_threshold"] is None
    assert shown["listen"] == "postgres://app@127.0.0.1:5432/telemachus"


def test_without_it_cursors_stay_and_listen_goes_where_django_does():
    shown = settings_with(DATABASE_URL="postgres://app@127.0.0.1:5432/telemachus")
    assert shown["cursors"] is False
    assert shown["listen"] == ""  # listen_connection_params() then takes Django's connection's


@pytest.mark.postgres
def test_the_listen_url_names_the_server_and_django_names_the_database(settings):
    """A test run's database is test_<name>, a deployment's whatever DATABASES says: the URL's
    own database name is never used, so LISTEN hears the database the NOTIFYs are sent in."""
    settings.TELEMACHUS_LISTEN_DATABASE_URL = "postgres://listener:pw@10.0.0.5:5433/elsewhere"
    params = listen_connection_params()
    assert params["dbname"] == connection.settings_dict["NAME"] != "elsewhere"
    assert (params["host"], params["port"], params["user"], params["password"]) == ("10.0.0.5", 5433, "listener", "pw")
    settings.TELEMACHUS_LISTEN_DATABASE_URL = ""
    assert listen_connection_params() == notify_connection_params()


def test_without_it_statements_are_bound_and_prepared_on_the_server():
    shown = settings_with(DATABASE_URL="postgres://app@127.0.0.1:5432/telemachus")
    assert (shown["options"]["server_side_binding"], shown["options"]["prepare_threshold"]) == (True, 5)
    shown = settings_with(DATABASE_URL="postgres://app@127.0.0.1:5432/telemachus", DATABASE_PREPARE="0")
    assert "server_side_binding" not in shown["options"] and "prepare_threshold" not in shown["options"]


def test_behind_pgbouncer_parameters_are_bound_in_the_client():
    shown = settings_with(DATABASE_URL="postgres://app@127.0.0.1:6432/telemachus", TELEMACHUS_PGBOUNCER="1")
    assert "server_side_binding" not in shown["options"]


@pytest.mark.postgres
def test_connections_of_our_own_prepare_as_django_does():
    """The delta sender's connection (NOTIFY in autocommit, the same statement again and again)
    keeps Django's prepare_threshold, so behind PgBouncer (None: never) its 6th NOTIFY does not
    land on a server connection that never saw the statement prepared."""
    assert notify_connection_params()["prepare_threshold"] == connection.get_connection_params()["prepare_threshold"]
