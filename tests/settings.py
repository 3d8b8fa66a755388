"""Test settings: production settings with only speed knobs changed."""

from telemachus.settings import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
