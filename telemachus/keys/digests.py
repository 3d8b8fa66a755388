"""Secrets and what is stored of them.

A secret is 192 random bits from the operating system's CSPRNG (`secrets`), behind a marker that
says what it is: `tm-` for an app's API key, `tmu-` for a person's token (secret scanners and
people recognise them; the marker also tells the lookup which table to read).

Only a keyed digest is stored: HMAC-SHA256 of the secret under a server key derived from
SECRET_KEY. A slow password hash (PBKDF2, Argon2) exists to make guessing a *low-entropy*
password from its hash expensive; a secret of 192 random bits cannot be guessed whatever the
hash costs (2^191 tries on average), so a slow hash would add only latency to every request.
The key makes the digest useless without SECRET_KEY too: a stolen table alone gives nothing to
test guesses against. The digest is deterministic, so the lookup is one indexed equality query.

Rotating SECRET_KEY: digests made under the keys in SECRET_KEY_FALLBACKS still match, so keys
keep working while the old key is listed there."""

import secrets

from django.conf import settings
from django.utils.crypto import salted_hmac

KEY_MARKER = "tm-"
TOKEN_MARKER = "tmu-"
SECRET_BYTES = 24  # 192 bits
# Characters of the secret kept for display: the marker and five random characters (30 bits of 192).
PREFIX_RANDOM_CHARS = 5
_SALT = "telemachus.keys.digest"


def secret_new(marker: str) -> str:
    """A fresh secret: the marker and 32 URL-safe characters."""
    return marker + secrets.token_urlsafe(SECRET_BYTES)


def secret_prefix(secret: str) -> str:
    """What is kept of a secret for display: its marker and the first few characters after it
    (a token from before markers: its first four characters)."""
    for marker in (TOKEN_MARKER, KEY_MARKER):
        if secret.startswith(marker):
            return secret[: len(marker) + PREFIX_RANDOM_CHARS]
    return secret[:4]


def secret_digest(secret: str, *, server_key: str | None = None) -> str:
    """HMAC-SHA256 of the secret, keyed by SECRET_KEY (or `server_key`), as 64 hex digits."""
    key = settings.SECRET_KEY if server_key is None else server_key
    return salted_hmac(_SALT, secret, secret=key, algorithm="sha256").hexdigest()


def secret_digests(secret: str) -> list[str]:
    """The digests the secret may be stored under: with SECRET_KEY, then each fallback."""
    return [secret_digest(secret, server_key=key) for key in [settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS]]


def is_api_key(secret: str) -> bool:
    return secret.startswith(KEY_MARKER)
