from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import connection

from scheduler.models import TeamShare


def team_shares_charge(*, charges: Mapping[int, float], now: datetime, half_life: float) -> None:
    """Add to teams' fair-share usage, decaying what was there to `now` first (as
    `TeamShare.decayed` does): one statement that reads, decays, charges and creates missing rows
    (INSERT ... ON CONFLICT DO UPDATE), which locks the teams' share rows in ascending team id
    (lock level 5, the last), so callers run it at the end of their transaction: the claim (the
    entry penalty of jobs it starts) and the finish (what attempts actually cost, less that
    penalty). A settlement (real cost less the entry penalty) may be negative; usage never is."""
    charges = {team_id: amount for team_id, amount in sorted(charges.items()) if amount}
    if not charges:
        return
    qn = connection.ops.quote_name
    table, team, usage, updated = (qn(TeamShare._meta.db_table), qn("team_id"), qn("usage"), qn("updated_at"))
    if connection.vendor == "postgresql":
        row, greatest = "(%s::bigint, %s::double precision)", "GREATEST"
        elapsed = f"EXTRACT(EPOCH FROM (excluded.{updated} - {table}.{updated}))"
    else:
        row, greatest = "(%s, %s)", "MAX"
        elapsed = f"(julianday(excluded.{updated}) - julianday({table}.{updated})) * 86400.0"
    decayed = f"{table}.{usage} * POWER(0.5, {greatest}({elapsed}, 0) / %s)" if half_life > 0 else "0.0"
    # A new row holds the charge (never below 0); a present one its decayed usage plus the charge.
    # (`WHERE true` tells SQLite's parser that ON CONFLICT is the upsert's, not a join's.)
    sql = (
        f"WITH v(team, charge) AS (VALUES {', '.join([row] * len(charges))}) "
        f"INSERT INTO {table} ({team}, {usage}, {updated}) "
        f"SELECT team, {greatest}(charge, 0.0), %s FROM v WHERE true ORDER BY team "
        f"ON CONFLICT ({team}) DO UPDATE SET "
        f"{usage} = {greatest}({decayed} + (SELECT charge FROM v WHERE v.team = excluded.{team}), 0.0), "
        f"{updated} = {greatest}(excluded.{updated}, {table}.{updated})"
    )
    params: list[Any] = [value for team_id, amount in charges.items() for value in (team_id, amount)]
    params.append(connection.ops.adapt_datetimefield_value(now))
    if half_life > 0:
        params.append(half_life)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
