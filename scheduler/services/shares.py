from collections.abc import Mapping
from datetime import datetime

from scheduler.bulk import update_rows
from scheduler.models import TeamShare


def team_shares_charge(*, charges: Mapping[int, float], now: datetime, half_life: float) -> None:
    """Add to teams' fair-share usage, decaying what was there to `now` first. Locks the teams'
    share rows in ascending team id (lock level 5, the last), so callers run it at the end of their
    transaction: the claim (the entry penalty of jobs it starts) and the finish (what attempts
    actually cost, less that penalty)."""
    charges = {team_id: amount for team_id, amount in charges.items() if amount}
    if not charges:
        return
    locked = TeamShare.objects.select_for_update().filter(team_id__in=sorted(charges)).order_by("team_id")
    shares = list(locked)
    missing = set(charges) - {share.team_id for share in shares}
    if missing:
        # A team's first charge: create its row (a concurrent first charge may win; then lock it).
        TeamShare.objects.bulk_create(
            [TeamShare(team_id=team_id, usage=0.0, updated_at=now) for team_id in missing], ignore_conflicts=True
        )
        shares = list(locked.all())
    update_rows(TeamShare, [
        # A settlement (real cost less the entry penalty) may be negative; usage never is.
        {"team": share.team_id, "usage": max(share.decayed(now, half_life) + charges[share.team_id], 0.0),
         "updated_at": max(now, share.updated_at)}
        for share in shares
    ], key="team")
