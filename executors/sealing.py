"""Executors' secrets at rest: sealed with Fernet (AES-128-CBC and HMAC-SHA256, from the
`cryptography` package, so no cryptography of our own), under keys from the settings.

Keys:

* TELEMACHUS_SECRETS_KEY: Fernet keys, comma-separated (make one with
  `python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"`).
  The first seals; every one unseals.
* Unset, the sealing key is derived from SECRET_KEY (HMAC-SHA256 under a salt of its own, so it is
  no other use's key). Keys derived from SECRET_KEY and from each of SECRET_KEY_FALLBACKS always
  unseal too, so a deployment that starts without TELEMACHUS_SECRETS_KEY can set one later.

Rotation: put the new key first (TELEMACHUS_SECRETS_KEY="NEW,OLD", or a new SECRET_KEY with the
old one in SECRET_KEY_FALLBACKS) on every API server and worker, run `manage.py
executor_secrets_rotate` (each stored secret unsealed and sealed again under the new key, its
original time kept), then drop the old key. A secret no key unseals is reported, never guessed at:
its executor's dispatches fail saying so (`SecretUnreadable`), and it shows as unreadable."""

from base64 import urlsafe_b64encode
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.crypto import salted_hmac

_DERIVE_SALT = "telemachus.executors.sealing-key"
_FINGERPRINT_SALT = "telemachus.executors.secret-fingerprint"


class SecretUnreadable(Exception):
    """A sealed secret that none of the configured keys opens."""


def _derived(secret_key: str) -> bytes:
    return urlsafe_b64encode(salted_hmac(_DERIVE_SALT, "fernet", secret=secret_key, algorithm="sha256").digest())


@lru_cache(maxsize=4)
def _box(explicit: tuple[str, ...], secret_keys: tuple[str, ...]) -> MultiFernet:
    try:
        given = [Fernet(key.encode()) for key in explicit]
    except ValueError:
        raise ImproperlyConfigured(
            "TELEMACHUS_SECRETS_KEY must be Fernet keys (32 url-safe base64-encoded bytes each), comma-separated."
        ) from None
    return MultiFernet([*given, *(Fernet(_derived(key)) for key in secret_keys)])


def sealing_keys() -> MultiFernet:
    """The configured keys: the sealing key first, then every key that may have sealed a stored
    secret. Raises ImproperlyConfigured for a malformed TELEMACHUS_SECRETS_KEY."""
    explicit = tuple(key.strip() for key in settings.TELEMACHUS_SECRETS_KEY.split(",") if key.strip())
    return _box(explicit, (settings.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS))


def secret_seal(plain: str) -> str:
    """The secret sealed under the current key (a Fernet token: random IV, time, MAC)."""
    return sealing_keys().encrypt(plain.encode()).decode()


def secret_unseal(token: str) -> str:
    """The secret a token seals. Raises SecretUnreadable when no configured key opens it."""
    try:
        return sealing_keys().decrypt(token.encode()).decode()
    except (InvalidToken, UnicodeError):
        raise SecretUnreadable(
            "a stored secret cannot be unsealed with TELEMACHUS_SECRETS_KEY or SECRET_KEY (and their fallbacks): "
            "was a key dropped before `manage.py executor_secrets_rotate` ran? Set the secret again."
        ) from None


def secret_reseal(token: str) -> str:
    """The token sealed again under the current key, with its original time. Raises
    SecretUnreadable as `secret_unseal` does."""
    try:
        return sealing_keys().rotate(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("a stored secret cannot be unsealed with the configured keys") from None


def secret_fingerprint(plain: str) -> str:
    """Eight hex digits of a keyed digest of the secret: tells two secrets apart (a change, two
    executors sharing a key) and says nothing of it without SECRET_KEY."""
    return salted_hmac(_FINGERPRINT_SALT, plain, algorithm="sha256").hexdigest()[:8]


def sealing_problem() -> str | None:
    """What is wrong with TELEMACHUS_SECRETS_KEY, for the start-up check; None when nothing is."""
    try:
        sealing_keys()
    except ImproperlyConfigured as exc:
        return str(exc)
    return None
