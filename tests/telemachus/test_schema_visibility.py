"""/api/schema/ and /api/docs/ are public with TELEMACHUS_PUBLIC_SCHEMA, which DEBUG turns on by
default (a development run) and production leaves off: then only a signed-in person, or a caller
with a token or key, reads them; anyone else gets 401."""

import json
import os
import subprocess
import sys

import pytest
from django.test import Client, override_settings

from tests.processes import ROOT

pytestmark = pytest.mark.django_db

PAGES = ("/api/schema/", "/api/docs/")


@override_settings(TELEMACHUS_PUBLIC_SCHEMA=False)
@pytest.mark.parametrize("page", PAGES)
def test_off_it_needs_a_signed_in_caller(page, api, make_user):
    assert Client().get(page).status_code == 401
    assert api(make_user()).get(page).status_code == 200  # a token
    session = Client()
    session.force_login(make_user())
    assert session.get(page).status_code == 200


@override_settings(TELEMACHUS_PUBLIC_SCHEMA=False)
def test_off_the_refusal_is_the_apis_error_in_the_schemas_format():
    answer = Client().get("/api/schema/", {"format": "json"})
    assert json.loads(answer.content)["error"] == "not_authenticated"
    assert b"error: not_authenticated" in Client().get("/api/schema/").content  # YAML, the default


@override_settings(TELEMACHUS_PUBLIC_SCHEMA=True)
@pytest.mark.parametrize("page", PAGES)
def test_on_anyone_reads_it(page):
    assert Client().get(page).status_code == 200


def public_schema(**env: str) -> bool:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TELEMACHUS_", "DEBUG"))}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, django; from django.conf import settings; django.setup(); "
            "print(json.dumps(settings.TELEMACHUS_PUBLIC_SCHEMA))",
        ],
        cwd=ROOT,
        env={
            **environ,
            "DJANGO_SETTINGS_MODULE": "telemachus.settings",
            "DATABASE_URL": "sqlite:////tmp/x.sqlite3",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def test_its_default_follows_debug_and_a_deployer_may_choose():
    production = {"DEBUG": "0", "SECRET_KEY": "k" * 50 + "-Zq9x"}
    assert public_schema() is True
    assert public_schema(**production) is False
    assert public_schema(**production, TELEMACHUS_PUBLIC_SCHEMA="1") is True
    assert public_schema(TELEMACHUS_PUBLIC_SCHEMA="0") is False
