"""Test settings: production settings with only speed knobs changed."""

import os

from telemachus.settings import *  # noqa: F403
from telemachus.settings import DATABASES, INSTALLED_APPS, VAR_DIR

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not :memory:, so tests can start worker processes that share the test database; one
    # per test run, so two runs on one machine do not share it.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}

# Workers run only Django tasks declared in installed apps; the tests declare theirs in `tests`.
INSTALLED_APPS = [*INSTALLED_APPS, "tests"]

if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Test threads that end without closing their connection would keep pool connections until the
    # pool runs dry (and block dropping the test database): tests use plain connections.
    DATABASES["default"]["OPTIONS"].pop("pool", None)
