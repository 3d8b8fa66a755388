"""Feature switches: operators turn job kinds (chat, translate, tool, task, flow) and the
OpenAI-compatible endpoint on or off, for everyone or for one team.

A team's own switch wins over the global one; with neither, a feature is on. `feature_require` is
the one check every entry point makes (job submit, the /v1/ endpoints), so a switched-off feature
is refused the same way everywhere: 403 `feature_disabled`."""

from collections.abc import Iterable, Mapping

from django.db import IntegrityError, transaction
from django.db.models import Q

from telemachus.control.audit import Actor, audit_record
from telemachus.db.locks import Level, rows_lock
from telemachus.errors import FeatureDisabled, ValidationFailed, unique_violation
from telemachus.models import FeatureSwitch, Team

FEATURES: tuple[str, ...] = tuple(FeatureSwitch.Feature.values)
OPENAI = FeatureSwitch.Feature.OPENAI.value


def feature_enabled(
    *, feature: str, team: Team | None, switches: Mapping[tuple[str, int | None], bool] | None = None
) -> bool:
    """Whether `feature` is on for `team` (None: the global switch). One query, or none from
    `switches` (all of them, (feature, team id or None) -> enabled: `feature_switches()`)."""
    if switches is not None:
        return feature_on(feature=feature, team_id=team.pk if team is not None else None, switches=switches)
    rows = FeatureSwitch.objects.filter(feature=feature)
    rows = rows.filter(Q(team__isnull=True) | Q(team=team)) if team is not None else rows.filter(team=None)
    states: dict[int | None, bool] = dict(rows.values_list("team_id", "enabled"))
    if team is not None and team.pk in states:
        return states[team.pk]
    return states.get(None, True)


def feature_switches() -> dict[tuple[str, int | None], bool]:
    """Every switch, for callers that keep them (the submit's configuration cache)."""
    return {
        (feature, team_id): enabled
        for feature, team_id, enabled in FeatureSwitch.objects.values_list("feature", "team_id", "enabled")
    }


def feature_on(*, feature: str, team_id: int | None, switches: Mapping[tuple[str, int | None], bool]) -> bool:
    """Whether `feature` is on for the team with this id (None: everyone), from the switches as
    read (`feature_switches()`, the configuration cache: no query): the team's own switch, else the
    global one, else on."""
    own = switches.get((feature, team_id)) if team_id is not None else None
    return own if own is not None else switches.get((feature, None), True)


def feature_require(
    *, feature: str, team: Team | None, switches: Mapping[tuple[str, int | None], bool] | None = None
) -> None:
    """Refuse (403 feature_disabled) when `feature` is switched off for `team` or for everyone."""
    feature = str(feature)  # callers pass Job.Type members too; the refusal names the plain value
    if not feature_enabled(feature=feature, team=team, switches=switches):
        where = f"team {team.slug!r}" if team is not None else "everyone"
        raise FeatureDisabled(
            f"{feature!r} is switched off for {where}.", feature=feature, team=team.slug if team is not None else None
        )


def feature_states(*, teams: Iterable[Team]) -> dict:
    """The switches as the API and the dashboard show them: the global state of each feature, and
    for each of `teams` its own switches (true / false; null: follows the global one) and what is
    in force."""
    teams = list(teams)
    rows = FeatureSwitch.objects.filter(Q(team__isnull=True) | Q(team__in=teams)).values_list(
        "feature", "team_id", "enabled"
    )
    switches = {(feature, team_id): enabled for feature, team_id, enabled in rows}
    glob = {feature: switches.get((feature, None), True) for feature in FEATURES}  # type: ignore[arg-type]
    return {
        "features": list(FEATURES),
        "global": glob,
        "teams": {
            team.slug: {
                "switches": {feature: switches.get((feature, team.pk)) for feature in FEATURES},
                "effective": {feature: switches.get((feature, team.pk), glob[feature]) for feature in FEATURES},
            }
            for team in teams
        },
    }


def feature_set(*, feature: str, team: Team | None, enabled: bool | None, by: Actor) -> None:
    """Switch `feature` on or off for everyone (team None) or for one team; for a team, `enabled`
    None removes its own switch, so it follows the global one again. Applies to the next
    request. Audited (`feature.set`) when it changes anything."""
    if feature not in FEATURES:
        raise ValidationFailed({"feature": [f"Unknown feature; known: {', '.join(FEATURES)}."]})
    if team is None and enabled is None:
        raise ValidationFailed({"enabled": ["The global switch is on or off (true or false)."]})
    try:
        _feature_write(feature=feature, team=team, enabled=enabled, by=by)
    except IntegrityError as exc:
        # A concurrent set created the switch's row after this one found none (there was no row
        # to lock). Setting a switch is idempotent: do it again, now updating that row, as if
        # this request had come a moment later.
        if not unique_violation(exc):
            raise
        _feature_write(feature=feature, team=team, enabled=enabled, by=by)


def _feature_write(*, feature: str, team: Team | None, enabled: bool | None, by: Actor) -> None:
    with transaction.atomic():
        switches = FeatureSwitch.objects.filter(feature=feature, team=team).order_by("pk")
        row = rows_lock(switches, level=Level.CONFIGURATION).first()
        was = row.enabled if row is not None else None
        if was == enabled:
            return
        if enabled is None:
            row.delete()  # type: ignore[union-attr]
        elif row is None:
            FeatureSwitch.objects.create(feature=feature, team=team, enabled=enabled)
        else:
            row.enabled = enabled
            row.save(update_fields=["enabled", "updated_at"])
        scope = team.slug if team is not None else "global"
        audit_record(
            by=by,
            action="feature.set",
            object_type="feature",
            object_id=f"{feature}:{scope}",
            object_repr=f"{feature} for {team.slug if team is not None else 'everyone'}",
            before={"enabled": was},
            after={"enabled": enabled},
        )
