"""Test settings: production settings with only speed knobs changed."""

from telemachus.settings import *  # noqa: F403
from telemachus.settings import DATABASES, VAR_DIR

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # A file, not :memory:, so tests can start worker processes that share the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}
