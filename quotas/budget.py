"""Token and request budgets: `ai.tokens` and `ai.requests` rules per fixed UTC window, at the
global, team, user and executor scopes, kept in the usage ledger (quotas.Usage).

Three moments touch a budget:
  submit  `quota_check` refuses (429 quota_exceeded) a job whose estimate the remaining budget
          cannot cover. Remaining = limit - used - reserved.
  claim   `Budgets` (read under the claim lock) defers jobs whose team or user is out of budget,
          at team level in the query, and reserves each placed job's estimate (and one request).
          Claims are serialized, so two workers cannot both spend the last of a budget; usage can
          overshoot a limit only by what attempts in flight use beyond their estimates.
  end     `quota_settle` releases the reservation and bills the actual tokens and one request to
          the window the attempt ended in (`quota_release` only releases, for an attempt that
          never dispatched or whose outcome is unknown).

Ledger rows are written only as increments (INSERT ... ON CONFLICT DO UPDATE), in sorted key
order, inside the transaction that makes the change (lock level 4, after job rows)."""

import calendar
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connection
from django.db.models import Q, Subquery

from quotas.models import QuotaPolicy, Usage
from quotas.rules import Rule, quota_rules
from telemachus.errors import QuotaExceeded

Dimension, Window = QuotaPolicy.Dimension, QuotaPolicy.Window
BUDGET_DIMENSIONS = (Dimension.TOKENS, Dimension.REQUESTS)
LedgerKey = tuple[str, str, str, datetime]  # scope, subject, window, window_start


def window_bounds(window: str, now: datetime) -> tuple[datetime, datetime]:
    """The fixed UTC window containing `now`: [start, end)."""
    now = now.astimezone(UTC)
    if window == Window.MINUTE:
        start = now.replace(second=0, microsecond=0)
        return start, start + timedelta(minutes=1)
    if window == Window.HOUR:
        start = now.replace(minute=0, second=0, microsecond=0)
        return start, start + timedelta(hours=1)
    if window == Window.DAY:
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=1)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    days = calendar.monthrange(start.year, start.month)[1]
    return start, start + timedelta(days=days)


@dataclass
class Account:
    """One budget rule in its current window."""

    rule: Rule
    start: datetime
    end: datetime
    used: int = 0
    reserved: int = 0
    exhausted_at: datetime | None = None

    @property
    def key(self) -> LedgerKey:
        return (self.rule.scope, self.rule.subject, self.rule.window, self.start)

    @property
    def remaining(self) -> int:
        return self.rule.limit - self.used - self.reserved

    def cost(self, tokens: int) -> int:
        return tokens if self.rule.dimension == Dimension.TOKENS else 1

    def describe(self) -> dict[str, Any]:
        """The fields of a quota_exceeded error and a deferred event."""
        return {
            "dimension": self.rule.dimension,
            "scope": self.rule.scope,
            "subject": self.rule.subject or None,
            "limit": self.rule.limit,
            "used": self.used + self.reserved,
            "reset_at": self.end.isoformat(),
        }


@dataclass
class Deltas:
    """Pending ledger increments, per key: [tokens, requests, reserved_tokens, reserved_requests]."""

    rows: dict[LedgerKey, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0, 0]))

    def add(
        self,
        key: LedgerKey,
        *,
        tokens: int = 0,
        requests: int = 0,
        reserved_tokens: int = 0,
        reserved_requests: int = 0,
    ) -> None:
        row = self.rows[key]
        row[0] += tokens
        row[1] += requests
        row[2] += reserved_tokens
        row[3] += reserved_requests

    def apply(self) -> None:
        ledger_add(self.rows)
        self.rows.clear()


class Budgets:
    """The budget rules and their current windows, as one claim (or one submit) sees them."""

    def __init__(self, accounts: list[Account], now: datetime) -> None:
        self.accounts = accounts
        self.now = now
        self.pending = Deltas()
        # Accounts that refused some job (`blocking`), so their window's end may let it start.
        self.refused: dict[LedgerKey, Account] = {}

    @classmethod
    def load(cls, *, now: datetime, rules: list[Rule] | None = None) -> "Budgets":
        """One query for the ledger rows of the current windows (none when there are no budget
        rules); `rules` are loaded too unless given."""
        budgets = cls.of(now=now, rules=quota_rules() if rules is None else rules)
        if budgets.accounts:
            wanted = Q()
            for account in budgets.accounts:
                wanted |= Q(
                    scope=account.rule.scope,
                    subject=account.rule.subject,
                    window=account.rule.window,
                    window_start=account.start,
                )
            rows = {(u.scope, u.subject, u.window, u.window_start): u for u in Usage.objects.filter(wanted)}
            for account in budgets.accounts:
                row = rows.get(account.key)
                if row is not None:
                    is_tokens = account.rule.dimension == Dimension.TOKENS
                    account.used = row.tokens if is_tokens else row.requests
                    account.reserved = row.reserved_tokens if is_tokens else row.reserved_requests
                    account.exhausted_at = row.exhausted_at
        return budgets

    @classmethod
    def of(cls, *, now: datetime, rules: Iterable[Rule]) -> "Budgets":
        """The budget rules among `rules`, in their current windows, with nothing read yet."""
        return cls([Account(r, *window_bounds(r.window, now)) for r in rules if r.dimension in BUDGET_DIMENSIONS], now)

    def columns(self) -> dict[str, Subquery]:
        """What each account has used and reserved, as columns (`budget_<i>_used`, `_reserved`) for
        a statement the caller runs anyway: `fill` takes them back. Saves the ledger's round trip."""
        columns = {}
        for i, account in enumerate(self.accounts):
            used, reserved = (
                ("tokens", "reserved_tokens")
                if account.rule.dimension == Dimension.TOKENS
                else ("requests", "reserved_requests")
            )
            scope, subject, window, start = account.key
            row = Usage.objects.filter(scope=scope, subject=subject, window=window, window_start=start)
            columns[f"budget_{i}_used"] = Subquery(row.values(used)[:1])
            columns[f"budget_{i}_reserved"] = Subquery(row.values(reserved)[:1])
        return columns

    def fill(self, values: dict[str, int | None]) -> None:
        """Take back the `columns` read with some statement."""
        for i, account in enumerate(self.accounts):
            account.used = values[f"budget_{i}_used"] or 0
            account.reserved = values[f"budget_{i}_reserved"] or 0

    def applicable(self, *, team_id: int, user_id: int, executor_id: int | None = None) -> list[Account]:
        return [a for a in self.accounts if a.rule.applies(team_id=team_id, user_id=user_id, executor_id=executor_id)]

    def blocking(self, *, team_id: int, user_id: int, tokens: int, executor_id: int | None = None) -> Account | None:
        """The first budget that cannot cover this job's estimate (and one request), if any. With
        `executor_id`, only that executor's own budgets are considered."""
        for account in self.applicable(team_id=team_id, user_id=user_id, executor_id=executor_id):
            if executor_id is not None and account.rule.scope != QuotaPolicy.Scope.EXECUTOR:
                continue
            if account.cost(tokens) > account.remaining:
                self.refused[account.key] = account
                return account
        return None

    def exhausted(self, scope: str) -> set[int]:
        """Ids of team or user subjects with nothing left in some budget."""
        return {
            a.rule.subject_id
            for a in self.accounts
            if a.rule.scope == scope and a.remaining <= 0 and a.rule.subject_id is not None
        }

    def global_exhausted(self) -> bool:
        return any(a.rule.scope == QuotaPolicy.Scope.GLOBAL and a.remaining <= 0 for a in self.accounts)

    def next_reset(self) -> datetime | None:
        """The earliest end of a window that refused a job or has run out: when it resets, work it
        held back may start."""
        ends = [a.end for a in self.accounts if a.remaining <= 0] + [a.end for a in self.refused.values()]
        return min(ends, default=None)

    def reserve(self, *, team_id: int, user_id: int, executor_id: int, tokens: int) -> dict[str, Any] | None:
        """Count the estimate against every budget the job counts against, for the rest of this
        claim; returns the reservation to store on the job (None when no budget applies), which
        `hold` writes to the ledger once the job is really started."""
        keys = []
        for account in self.applicable(team_id=team_id, user_id=user_id, executor_id=executor_id):
            account.reserved += account.cost(tokens)
            keys.append([*account.key[:3], account.start.isoformat(), account.rule.dimension])
        return {"tokens": tokens, "keys": keys} if keys else None

    def hold(self, reservations: Iterable[dict[str, Any] | None]) -> None:
        """Write reservations to the ledger."""
        for reservation in reservations:
            _add_reservation(self.pending, reservation, sign=+1)
        self.pending.apply()

    def note_exhausted(self) -> list[Account]:
        """Budgets found empty for the first time in their window: marked, and returned so the
        caller records one `deferred` event each (not one per poll)."""
        fresh = [a for a in self.accounts if a.remaining <= 0 and a.exhausted_at is None]
        for account in fresh:
            self.pending.add(account.key)
        self.pending.apply()
        for account in fresh:
            scope, subject, window, start = account.key
            Usage.objects.filter(
                scope=scope, subject=subject, window=window, window_start=start, exhausted_at__isnull=True
            ).update(exhausted_at=self.now)
            account.exhausted_at = self.now
        return fresh


def admission_budgets(*, subjects: Iterable[tuple[int, int]], now: datetime, rules: Iterable[Rule]) -> Budgets:
    """The global, team and user budgets that count jobs of these (team id, user id) pairs, not
    yet read (`Budgets.columns` reads them with a statement of the caller's)."""
    subjects = list(subjects)
    return Budgets.of(
        now=now,
        rules=[
            rule
            for rule in rules
            if rule.scope != QuotaPolicy.Scope.EXECUTOR
            and any(rule.applies(team_id=team_id, user_id=user_id) for team_id, user_id in subjects)
        ],
    )


def quota_check(*, team_id: int, user_id: int, tokens: int, now: datetime, budgets: Budgets | None = None) -> None:
    """Admission: refuse a job that the remaining budget of its team, its user or the whole
    installation cannot cover, with what ran out and when it resets. Executor budgets are
    checked at placement, where the executor is known. `budgets` (admission_budgets, read) spares
    the reads: the caller read them with a statement of its own, or checks several jobs."""
    budgets = budgets if budgets is not None else Budgets.load(now=now)
    account = budgets.blocking(team_id=team_id, user_id=user_id, tokens=tokens) if budgets.accounts else None
    if account is None:
        return
    raise QuotaExceeded(
        f"The {account.rule.dimension} budget of {account.rule.scope} {account.rule.subject or ''}".rstrip()
        + f" has {max(account.remaining, 0)} left per {account.rule.window}; this job needs {account.cost(tokens)}.",
        **account.describe(),
    )


@dataclass(frozen=True)
class Bill:
    """One dispatch to bill: its actual tokens, for this team, user and executor."""

    team_id: int
    user_id: int
    executor_id: int | None
    tokens: int


def quota_settle(
    *,
    reservations: Iterable[dict[str, Any] | None],
    bills: Iterable[Bill],
    now: datetime,
    rules: Iterable[Rule] | None = None,
) -> None:
    """Quota.record: release the reservations of ended attempts and bill each dispatch's actual
    tokens and one request to the current window of every budget that counts it. `rules` (all
    quota rules, as cached) spares reading them."""
    deltas = Deltas()
    for reservation in reservations:
        _add_reservation(deltas, reservation, sign=-1)
    bills = list(bills)
    if bills:
        rules = (
            [r for r in rules if r.dimension in BUDGET_DIMENSIONS]
            if rules is not None
            else quota_rules(dimensions=BUDGET_DIMENSIONS)
        )
        budgets = Budgets.of(now=now, rules=rules)
        for bill in bills:
            for account in budgets.applicable(team_id=bill.team_id, user_id=bill.user_id, executor_id=bill.executor_id):
                if account.rule.dimension == Dimension.TOKENS:
                    deltas.add(account.key, tokens=bill.tokens)
                else:
                    deltas.add(account.key, requests=1)
    deltas.apply()


def _add_reservation(deltas: Deltas, reservation: dict[str, Any] | None, *, sign: int) -> None:
    """Hold (+1) or release (-1) a reservation in the windows it was made in."""
    if not reservation:
        return
    for scope, subject, window, start, dimension in reservation["keys"]:
        key = (scope, subject, window, datetime.fromisoformat(start))
        if dimension == Dimension.TOKENS:
            deltas.add(key, reserved_tokens=sign * reservation["tokens"])
        else:
            deltas.add(key, reserved_requests=sign)


def ledger_add(rows: dict[LedgerKey, list[int]]) -> None:
    """Add to ledger rows, creating them as needed, in one statement, in key order (so concurrent
    writers lock rows in the same order)."""
    if not rows:
        return
    qn = connection.ops.quote_name
    table = qn(Usage._meta.db_table)
    start_field = Usage._meta.get_field("window_start")
    columns = [
        "scope",
        "subject",
        "window",
        "window_start",
        "tokens",
        "requests",
        "reserved_tokens",
        "reserved_requests",
    ]
    params: list[Any] = []
    for (scope, subject, window, start), values in sorted(rows.items()):
        params += [scope, subject, window, start_field.get_db_prep_value(start, connection), *values]
    placeholders = ", ".join(["(" + ", ".join(["%s"] * len(columns)) + ")"] * len(rows))
    increments = ", ".join(f"{qn(c)} = {table}.{qn(c)} + excluded.{qn(c)}" for c in columns[4:])
    sql = (
        f"INSERT INTO {table} ({', '.join(qn(c) for c in columns)}) VALUES {placeholders} "
        f"ON CONFLICT ({', '.join(qn(c) for c in columns[:4])}) DO UPDATE SET {increments}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
