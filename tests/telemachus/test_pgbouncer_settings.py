"""Behind PgBouncer in transaction pooling (TELEMACHUS_PGBOUNCER=1) the settings turn off what
needs a server session: server-side cursors and prepared statements; LISTEN gets a URL of its own.
Read from a fresh process, as a deployment reads them."""

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_without_it_the_listen_url_is_the_database_url_and_cursors_stay():
    shown = settings_with(DATABASE_URL="postgres://app@127.0.0.1:5432/telemachus")
    assert shown["cursors"] is False
    assert shown["listen"] == "postgres://app@127.0.0.1:5432/telemachus"
