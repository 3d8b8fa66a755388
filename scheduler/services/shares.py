from collections.abc import Mapping
from datetime import datetime

from scheduler.models import TeamShare
from telemachus.db.bulk import upsert_decayed


def team_shares_charge(*, charges: Mapping[int, float], now: datetime, half_life: float) -> None:
    """Add to teams' fair-share usage, decaying what was there to `now` first (as
    `TeamShare.decayed` does): one statement that reads, decays, charges and creates missing rows,
    which locks the teams' share rows in ascending team id (lock level 5, the last), so callers
    run it at the end of their transaction: the claim (the entry penalty of jobs it starts) and
    the finish (what attempts actually cost, less that penalty). A settlement (real cost less the
    entry penalty) may be negative; usage never is."""
    upsert_decayed(
        TeamShare,
        {team_id: amount for team_id, amount in charges.items() if amount},
        key="team",
        value="usage",
        stamp="updated_at",
        now=now,
        half_life=half_life,
    )
