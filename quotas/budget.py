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

from django.db.models import Q

from quotas.models import ZERO, QuotaPolicy, Spend, Usage, money_text
from quotas.rules import Rule, quota_rules
from quotas.thresholds import budget_thresholds_emit
from telemachus.db.bulk import upsert_add
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

    def apply(self) -> "dict[LedgerKey, tuple[int, Decimal]]":
        """Write the increments; returns each row's used tokens and cost after them."""
        totals = ledger_add(self.rows)
        self.rows.clear()
        return totals


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
        budgets.read()
        return budgets

    def read(self) -> None:
        """Read the ledger rows of the accounts' current windows (one query; none without accounts)."""
        if not self.accounts:
            return
        wanted = Q()
        for account in self.accounts:
            wanted |= Q(
                scope=account.rule.scope,
                subject=account.rule.subject,
                window=account.rule.window,
                window_start=account.start,
            )
        rows = {(u.scope, u.subject, u.window, u.window_start): u for u in Usage.objects.filter(wanted)}
        for account in self.accounts:
            row = rows.get(account.key)
            if row is not None:
                used, reserved = LEDGER_COLUMNS[account.rule.dimension]  # type: ignore[index]
                account.used, account.reserved = getattr(row, used), getattr(row, reserved)
                account.exhausted_at = row.exhausted_at

    @classmethod
    def of(cls, *, now: datetime, rules: Iterable[Rule]) -> "Budgets":
        """The budget rules among `rules`, in their current windows, with nothing read yet."""
        return cls([Account(r, *window_bounds(r.window, now)) for r in rules if r.dimension in BUDGET_DIMENSIONS], now)

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
    yet read (`Budgets.read`)."""
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
    them. A token or money budget whose use this moves past 80 % or 100 % of its limit emits
    `budget.threshold` or `budget.exhausted` to the webhooks of the teams it concerns
    (quotas/thresholds.py), in this transaction: once per rule, window and threshold, since use
    only grows within a window and each settle sees its own before and after under the row's lock."""
    deltas = Deltas()
    for reservation in reservations:
        _add_reservation(deltas, reservation, sign=-1)
    bills = list(bills)
    budgets = Budgets([], now)
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
    billed = {key: (row[0], row[4]) for key, row in deltas.rows.items() if row[0] or row[4]}
    totals = deltas.apply()
    if crossings := budget_crossings(accounts=budgets.accounts, billed=billed, totals=totals):
        budget_thresholds_emit(crossings=crossings, bills=bills, now=now)
    spend_add(bills=bills, day=now.astimezone(UTC).date())


@dataclass(frozen=True)
class Crossing:
    """A token or money budget whose use one settle moved past a threshold of its limit."""

    account: Account
    used: Amount  # after the settle
    percent: int  # 80 or 100


THRESHOLDS = ((80, Decimal("0.8")), (100, Decimal(1)))


def budget_crossings(
    *,
    accounts: Iterable[Account],
    billed: dict[LedgerKey, tuple[Amount, Amount]],
    totals: dict[LedgerKey, tuple[int, Decimal]],
) -> list[Crossing]:
    """The thresholds that the billed amounts moved the accounts' use past: use before the settle
    (the total after it, less what it billed) under the mark, use after it at or over."""
    crossings = []
    for account in accounts:
        if account.rule.dimension not in (Dimension.TOKENS, Dimension.COST) or account.rule.limit <= 0:
            continue
        column = 1 if account.is_money else 0
        added: Amount = billed.get(account.key, (0, ZERO))[column]
        if not added or account.key not in totals:
            continue
        after: Amount = totals[account.key][column]
        before = after - added
        for percent, fraction in THRESHOLDS:
            mark = account.rule.limit * fraction
            if before < mark <= after:
                crossings.append(Crossing(account=account, used=after, percent=percent))
    return crossings


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


def ledger_add(rows: dict[LedgerKey, list[Amount]]) -> dict[LedgerKey, tuple[int, Decimal]]:
    """Add to ledger rows, creating them as needed, in one statement, in key order (so concurrent
    writers lock rows in the same order). Returns each row's used tokens and cost after the
    addition, read in the same round trip (RETURNING)."""
    keys = ("scope", "subject", "window", "window_start")
    totals = upsert_add(
        Usage,
        rows,
        keys=keys,
        adds=("tokens", "requests", "reserved_tokens", "reserved_requests", "cost", "reserved_cost"),
        returning=(*keys, "tokens", "cost"),
    )
    return {
        (scope, subject, window, start): (int(tokens), cost) for scope, subject, window, start, tokens, cost in totals
    }


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
    upsert_add(
        Spend,
        rows,
        keys=("day", "team", "user", "model"),
        adds=("requests", "tokens", "prompt_tokens", "completion_tokens", "cost"),
        first=("key",),
    )
