"""Who is calling a model API, and for which team: the key or token (auth.py), the team it acts for
(named by X-Telemachus-Team, or the caller's only one), the `openai` feature switch, and the
caller's rate of /v1/ calls. The one point every model call passes once its caller and team are
known; run on a database thread."""

from dataclasses import dataclass

from django.conf import settings

from scheduler.core.configuration import configuration, grants
from scheduler.gateway.auth import CredentialRefused, TooManyFailures, credential_for
from scheduler.gateway.errors import TEAM_HEADER, GatewayError, not_authenticated
from telemachus.control.config import ConfigSnapshot, config_believed
from telemachus.control.features import OPENAI, feature_require
from telemachus.http.throttles import caller_ident, rate_parse, rate_take
from telemachus.models import ApiKey, Team
from telemachus.teams import rbac

__all__ = ["TEAM_HEADER", "Caller", "caller_for", "rate_require", "team_of"]


@dataclass(frozen=True)
class Caller:
    user: rbac.Principal
    team: Team
    key: ApiKey | None = None

    def may_call(self, model: str) -> bool:
        """Whether the caller's key (if it came with one) lets it call the model."""
        return self.key is None or not self.key.allowed_models or model in self.key.allowed_models


def caller_for(
    *, authorization: str | None, team: str | None, confirm: bool, address: str, api_key_header: str | None = None
) -> Caller:
    """Authenticate the key or token, find the team the call acts for and refuse the call (403
    feature_disabled) if the `openai` switch is off for that team or for everyone: the one point
    every /v1/ call passes once its caller and team are known. The team, the memberships and the
    switches are the cached configuration; with `confirm` False, what this process last used,
    unconfirmed (no query), for a submit, which chooses the team again from the configuration its
    statement confirms (so a membership just added or removed is never missed). A refusal (no
    such team, not a member, in several, switched off) is believed only from a confirmed read
    (`config_believed`). A refused credential: 401 saying why, in the protocol's own header
    (`api_key_header`); too many from `address`: 429 with Retry-After. Each call counts against
    the caller's TELEMACHUS_OPENAI_RATE (429 rate_limit_exceeded past it)."""
    try:
        credential = credential_for(authorization=authorization, address=address)
    except TooManyFailures as exc:
        raise GatewayError(
            429,
            str(exc),
            type="rate_limit_error",
            code="too_many_authentication_failures",
            headers={"retry-after": str(exc.retry_after)},
            retry=exc.retry_after <= 60,
        ) from None
    except CredentialRefused as exc:
        raise not_authenticated(api_key_header=api_key_header, refusal=str(exc)) from None
    if credential is None:
        raise not_authenticated(api_key_header=api_key_header)
    user = credential.user
    rate_require(user=user)

    def check(snapshot: ConfigSnapshot) -> Caller:
        found = team_of(user, team, snapshot)
        feature_require(feature=OPENAI, team=found, switches=configuration(snapshot).features)
        return Caller(user=user, team=found, key=credential.key)

    return config_believed(check, confirmed=confirm)


def rate_require(*, user: rbac.Principal) -> None:
    """Count one /v1/ call against the user's (an app key's own principal's) rate, or refuse it
    with 429 and Retry-After (the SDKs wait that long and try again on their own)."""
    rate = rate_parse(settings.TELEMACHUS_OPENAI_RATE)
    wait = rate_take(scope="openai", ident=caller_ident(user, None), rate=rate) if rate is not None else None
    if wait is not None:
        raise GatewayError(
            429,
            f"Rate limit reached: at most {settings.TELEMACHUS_OPENAI_RATE} calls; try again in {wait} s.",
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"retry-after": str(wait)},
        )


def team_of(user: rbac.Principal, slug: str | None, snapshot: ConfigSnapshot) -> Team:
    """The team named, if the caller may act in it (TeamNotFound otherwise, as for other teams'
    objects), else the caller's only team (TeamRequired when in none or several): the submit's own
    rules (rbac.Grants), read from the configuration snapshot, so an unchanged configuration costs
    no query."""
    config, allowed = configuration(snapshot), grants(snapshot, user)
    return allowed.team_for_submit(config.team(slug), slug) if slug else allowed.only_team(config.teams)
