"""API tokens for tests, as apps get them: a real personal token (stored as its digest) whose
secret the test keeps. Written straight to the table, as DRF's `Token.objects.create` was, so a
test's audit log holds only what the test itself did."""

from telemachus.keys.digests import TOKEN_MARKER, secret_digest, secret_new, secret_prefix
from telemachus.keys.models import PersonalToken


def token_for(user) -> str:
    """A new personal token of `user`; its secret."""
    secret = secret_new(TOKEN_MARKER)
    PersonalToken.objects.create(user=user, name="test", prefix=secret_prefix(secret), digest=secret_digest(secret))
    return secret
