"""Token, request and money budgets: `ai.tokens`, `ai.requests` and `ai.cost` rules per fixed UTC
window, at the global, team, user, key and executor scopes, kept in the usage ledger (quotas.Usage).
Money is Decimal throughout (never float), in TELEMACHUS_CURRENCY; a job's money estimate and an
attempt's cost are priced by the caller (the executors' prices) and handed in.

Three moments touch a budget:
  submit  `quota_check` refuses (429 quota_exceeded) a job whose estimate the remaining budget
          cannot cover. Remaining = limit - used - reserved.
  claim   `Budgets` (read under the claim lock) defers jobs whose team or user is out of budget,
          at team level in the query, and reserves each placed job's estimate (and one request).
          Claims are serialized, so two workers cannot both spend the last of a budget; usage can
          overshoot a limit only by what attempts in flight use beyond their estimates.
  end     `quota_settle` releases the reservation and bills the actual tokens, one request and the
          attempt's cost to the window the attempt ended in, and adds it to the spend ledger
          (quotas.Spend: per day, team, user and model, for /api/spend/).

Ledger rows are written only as increments (INSERT ... ON CONFLICT DO UPDATE), in sorted key
order, inside the transaction that makes the change (lock level 4, after job rows): usage rows
first, then spend rows."""

import calendar
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models import Q, Subquery

from quotas.models import ZERO, QuotaPolicy, Spend, Usage, money_text
from quotas.rules import Rule, quota_rules
from telemachus.errors import QuotaExceeded

Dimension, Window = QuotaPolicy.Dimension, QuotaPolicy.Window
BUDGET_DIMENSIONS = (Dimension.TOKENS, Dimension.REQUESTS, Dimension.COST)
# The ledger columns of each budget dimension: what was used, and what attempts in flight hold.
LEDGER_COLUMNS = {
    Dimension.TOKENS: ("tokens", "reserved_tokens"),
    Dimension.REQUESTS: ("requests", "reserved_requests"),
    Dimension.COST: ("cost", "reserved_cost"),
}
LedgerKey = tuple[str, str, str, datetime]  # scope, subject, window, window_start
Amount = int | Decimal  # whole tokens or requests; money


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
    used: Amount = 0
    reserved: Amount = 0
    exhausted_at: datetime | None = None

    @property
    def key(self) -> LedgerKey:
        return (self.rule.scope, self.rule.subject, self.rule.window, self.start)

    @property
    def remaining(self) -> Amount:
        return self.rule.limit - self.used - self.reserved  # type: ignore[no-any-return]

    @property
    def is_money(self) -> bool:
        return self.rule.dimension == Dimension.COST

    def cost(self, tokens: int, money: Decimal = ZERO) -> Amount:
        """What one attempt of a job counts against this budget: its tokens, one request, or its
        money (the estimate at admission and claim, the actual cost when billed)."""
        if self.rule.dimension == Dimension.TOKENS:
            return tokens
        return money if self.is_money else 1

    def show(self, amount: Amount) -> Any:
        """An amount as JSON carries it: money as a decimal string, counts as numbers."""
        return money_text(Decimal(amount)) if self.is_money else amount

    def describe(self) -> dict[str, Any]:
        """The fields of a quota_exceeded error and a deferred event."""
        return {
            "dimension": self.rule.dimension,
            "scope": self.rule.scope,
            "subject": self.rule.subject or None,
            "limit": self.show(self.rule.limit),
            "used": self.show(self.used + self.reserved),
            "reset_at": self.end.isoformat(),
        }


@dataclass
class Deltas:
    """Pending ledger increments, per key: [tokens, requests, reserved_tokens, reserved_requests,
    cost, reserved_cost]."""

    rows: dict[LedgerKey, list[Amount]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0, 0, ZERO, ZERO]))

    def add(
        self,
        key: LedgerKey,
        *,
        tokens: int = 0,
        requests: int = 0,
        reserved_tokens: int = 0,
        reserved_requests: int = 0,
        cost: Decimal = ZERO,
        reserved_cost: Decimal = ZERO,
    ) -> None:
        row = self.rows[key]
        row[0] += tokens
        row[1] += requests
        row[2] += reserved_tokens
        row[3] += reserved_requests
        row[4] += cost
        row[5] += reserved_cost

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
                    used, reserved = LEDGER_COLUMNS[account.rule.dimension]  # type: ignore[index]
                    account.used, account.reserved = getattr(row, used), getattr(row, reserved)
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
            used, reserved = LEDGER_COLUMNS[account.rule.dimension]  # type: ignore[index]
            scope, subject, window, start = account.key
            row = Usage.objects.filter(scope=scope, subject=subject, window=window, window_start=start)
            columns[f"budget_{i}_used"] = Subquery(row.values(used)[:1])
            columns[f"budget_{i}_reserved"] = Subquery(row.values(reserved)[:1])
        return columns

    def fill(self, values: dict[str, Any]) -> None:
        """Take back the `columns` read with some statement."""
        for i, account in enumerate(self.accounts):
            account.used = values[f"budget_{i}_used"] or 0
            account.reserved = values[f"budget_{i}_reserved"] or 0

    @property
    def has_money(self) -> bool:
        """Whether some `ai.cost` budget is in force (else nobody needs a job's money estimate)."""
        return any(account.is_money for account in self.accounts)

    def applicable(self, *, team_id: int, user_id: int, executor_id: int | None = None) -> list[Account]:
        return [a for a in self.accounts if a.rule.applies(team_id=team_id, user_id=user_id, executor_id=executor_id)]

    def blocking(
        self,
        *,
        team_id: int,
        user_id: int,
        tokens: int,
        executor_id: int | None = None,
        money: Decimal = ZERO,
    ) -> Account | None:
        """The first budget that cannot cover this job's estimate (its tokens, one request, its
        money estimate), if any. With `executor_id`, only that executor's own budgets are considered."""
        for account in self.applicable(team_id=team_id, user_id=user_id, executor_id=executor_id):
            if executor_id is not None and account.rule.scope != QuotaPolicy.Scope.EXECUTOR:
                continue
            if account.cost(tokens, money) > account.remaining:
                self.refused[account.key] = account
                return account
        return None

    def exhausted(self, scope: str) -> set[int]:
        """Ids of team or user subjects (a key scope: the key's user) with nothing left in some budget."""
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

    def reserve(
        self, *, team_id: int, user_id: int, executor_id: int, tokens: int, money: Decimal = ZERO
    ) -> dict[str, Any] | None:
        """Count the estimate against every budget the job counts against, for the rest of this
        claim; returns the reservation to store on the job (None when no budget applies), which
        `hold` writes to the ledger once the job is really started. `money`: the estimate priced
        on the executor it is placed on, kept (as a decimal string) when a money budget applies."""
        keys = []
        for account in self.applicable(team_id=team_id, user_id=user_id, executor_id=executor_id):
            account.reserved += account.cost(tokens, money)
            keys.append([*account.key[:3], account.start.isoformat(), account.rule.dimension])
        if not keys:
            return None
        reservation: dict[str, Any] = {"tokens": tokens, "keys": keys}
        if any(dimension == Dimension.COST for *_, dimension in keys):
            reservation["cost"] = money_text(money)
        return reservation

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


def quota_check(
    *,
    team_id: int,
    user_id: int,
    tokens: int,
    now: datetime,
    budgets: Budgets | None = None,
    money: Decimal = ZERO,
) -> None:
    """Admission: refuse a job that the remaining budget of its team, its user, its key or the
    whole installation cannot cover, with what ran out and when it resets. Executor budgets are
    checked at placement, where the executor is known. `money` is the job's money estimate (its
    counted prompt at the input price, its max_tokens at the output price, on the dearest executor
    that could take it). `budgets` (admission_budgets, read) spares the reads: the caller read them
    with a statement of its own, or checks several jobs."""
    budgets = budgets if budgets is not None else Budgets.load(now=now)
    account = (
        budgets.blocking(team_id=team_id, user_id=user_id, tokens=tokens, money=money) if budgets.accounts else None
    )
    if account is None:
        return
    left = account.show(max(account.remaining, 0))
    raise QuotaExceeded(
        f"The {account.rule.dimension} budget of {account.rule.scope} {account.rule.subject or ''}".rstrip()
        + f" has {left} left per {account.rule.window}; this job needs {account.show(account.cost(tokens, money))}.",
        **account.describe(),
    )


@dataclass(frozen=True)
class Bill:
    """One dispatch to bill: its actual tokens and cost, for this team, user and executor. `model`,
    `key_id` and the token split feed the spend ledger (prompt and completion tokens, when the
    split is known; `tokens` is the total billed either way)."""

    team_id: int
    user_id: int
    executor_id: int | None
    tokens: int
    cost: Decimal = ZERO
    model: str = ""
    key_id: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def quota_settle(
    *,
    reservations: Iterable[dict[str, Any] | None],
    bills: Iterable[Bill],
    now: datetime,
    rules: Iterable[Rule] | None = None,
) -> None:
    """Quota.record: release the reservations of ended attempts and bill each dispatch's actual
    tokens, one request and its cost to the current window of every budget that counts it, then
    add what was spent to the spend ledger. `rules` (all quota rules, as cached) spares reading
    them."""
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
                elif account.is_money:
                    deltas.add(account.key, cost=bill.cost)
                else:
                    deltas.add(account.key, requests=1)
    deltas.apply()
    spend_add(bills=bills, day=now.astimezone(UTC).date())


def _add_reservation(deltas: Deltas, reservation: dict[str, Any] | None, *, sign: int) -> None:
    """Hold (+1) or release (-1) a reservation in the windows it was made in."""
    if not reservation:
        return
    for scope, subject, window, start, dimension in reservation["keys"]:
        key = (scope, subject, window, datetime.fromisoformat(start))
        if dimension == Dimension.TOKENS:
            deltas.add(key, reserved_tokens=sign * reservation["tokens"])
        elif dimension == Dimension.COST:
            deltas.add(key, reserved_cost=sign * Decimal(reservation.get("cost") or 0))
        else:
            deltas.add(key, reserved_requests=sign)


def ledger_add(rows: dict[LedgerKey, list[Amount]]) -> None:
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
        "cost",
        "reserved_cost",
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


SpendKey = tuple[date, int, int, str]  # day, team, user, model


def spend_add(*, bills: Iterable[Bill], day: date) -> None:
    """Add the bills that used tokens or cost money to the spend ledger, one row per day, team,
    user and model, created as needed; one statement, rows in key order (so concurrent writers
    lock them in the same order), after the usage rows (lock level 4)."""
    rows: dict[SpendKey, list[Any]] = {}
    for bill in bills:
        if not bill.model or (bill.tokens <= 0 and bill.cost <= 0):
            continue
        row = rows.setdefault((day, bill.team_id, bill.user_id, bill.model), [bill.key_id, 0, 0, 0, 0, ZERO])
        row[1] += 1
        row[2] += bill.tokens
        row[3] += bill.prompt_tokens
        row[4] += bill.completion_tokens
        row[5] += bill.cost
    if not rows:
        return
    qn = connection.ops.quote_name
    table = qn(Spend._meta.db_table)
    columns = ["day", "team_id", "user_id", "model", "key_id", "requests", "tokens", "prompt_tokens"]
    columns += ["completion_tokens", "cost"]
    day_field, cost_field = Spend._meta.get_field("day"), Spend._meta.get_field("cost")
    params: list[Any] = []
    for (when, team_id, user_id, model), (key_id, *values) in sorted(rows.items()):
        values[-1] = cost_field.get_db_prep_save(values[-1], connection)
        params += [day_field.get_db_prep_value(when, connection), team_id, user_id, model, key_id, *values]
    placeholders = ", ".join(["(" + ", ".join(["%s"] * len(columns)) + ")"] * len(rows))
    increments = ", ".join(f"{qn(c)} = {table}.{qn(c)} + excluded.{qn(c)}" for c in columns[5:])
    sql = (
        f"INSERT INTO {table} ({', '.join(qn(c) for c in columns)}) VALUES {placeholders} "
        f"ON CONFLICT ({', '.join(qn(c) for c in columns[:4])}) DO UPDATE SET {increments}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
