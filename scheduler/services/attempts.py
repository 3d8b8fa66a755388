"""An attempt's end: the one place where the capacity an attempt held is given back and what it
used is settled, whichever way it ends (a finish, a flow's round, a cancel, a recovery, a worker
giving its jobs back).

An attempt (a job's run on an executor, or one round of a flow or governed slot) holds a slot, a
budget reservation made at its claim, and an entry penalty charged to its team's fair share at
its claim. When it ends, in the transaction that writes its job's new state:

  slot          deleted, which frees the capacity at every scope (in-use counts are counted from
                slots); the workers are told when the caller asks (`wake`).
  budgets       the reservation released, and, when the model's work is known (`tokens` not
                None), the tokens, one request and their cost billed to every budget that counts
                them, and added to the spend ledger. The cost is priced when the end is made
                (`AttemptEnd.of`: tokens x the executor's prices) and added to the job's `cost`.
  fair share    the team charged what the attempt really cost (slot-seconds or tokens, per the
                queue policy) less the entry penalty already charged; not when the outcome is
                unknown (`charge` False: a worker vanished, or gave the job back unstarted).
"""

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from executors.models import Executor
from quotas.budget import Bill, quota_settle
from quotas.models import ZERO
from quotas.rules import Rule
from scheduler.core.money import attempt_price
from scheduler.models import Job, QueuePolicy, Slot
from scheduler.services.shares import team_shares_charge
from telemachus.control import notify
from telemachus.db.bulk import delete_sent
from telemachus.db.notify import notice, notices_supported
from telemachus.db.pipeline import committing
from telemachus.db.statements import NO_RIDERS, Riders


@dataclass(frozen=True)
class AttemptEnd:
    """One attempt that ends: its job (locked by the caller, level 3), the budget reservation
    its claim made (read before the job's end clears it), the tokens it used (None: no model call
    is known to have been made, so nothing is billed), and whether fair share is charged what it
    cost."""

    job: Job
    reservation: dict[str, Any] | None
    tokens: int | None
    charge: bool = True
    # What the tokens cost (Decimal, in TELEMACHUS_CURRENCY), and how many were prompt and
    # completion, as priced by `of`.
    cost: Decimal = ZERO
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The model the attempt ran (a routed job's moves on before its end is billed: Job.fall_back).
    model: str = ""

    @classmethod
    def of(
        cls,
        job: Job,
        *,
        tokens: int | None,
        charge: bool = True,
        executor: Executor | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cost: Decimal | None = None,
    ) -> "AttemptEnd":
        """The end of the job's attempt. With `tokens`, prices them on `executor` (the prompt and
        completion split as reported; tokens without one count as completion), or takes `cost`
        as given (a canceled attempt: what its reservation held), and adds it to the job's
        `cost` (`Job.cost_add`; not saved: the caller writes the job's changes)."""
        price, prompt, completion = ZERO, 0, 0
        if tokens is not None:
            price, prompt, completion = attempt_price(
                executor,
                job.model,
                tokens=tokens,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                batch=job.batch_id is not None,
            )
            if cost is not None:
                price = cost
            job.cost_add(price)
        return cls(
            job=job,
            reservation=job.reservation,
            tokens=tokens,
            charge=charge,
            cost=price,
            prompt_tokens=prompt,
            completion_tokens=completion,
            model=job.model,
        )


def attempts_end(
    *,
    ends: Sequence[AttemptEnd],
    now: datetime,
    record: QueuePolicy,
    wake: bool,
    rules: Iterable[Rule] | None = None,
    freed: Callable[[], dict[int, datetime]] | None = None,
    commit: bool = False,
) -> None:
    """Free the attempts' slots, settle their budgets and charge fair share, in the caller's
    transaction, which holds their job rows (level 3): ledger rows next (level 4), then team
    shares (level 5), so call it last. Releases each job's `reservation` (`Job.reservation_released`;
    not saved: the caller writes the job's changes).

    `wake`: tell the workers that slots were freed (not when the caller will claim with them
    itself, or keeps them for the flow's next round). `rules`: the quota rules as cached, to
    spare reading them. `freed`: the slots' DELETE, sent already with the caller's statements
    (`slots_free_sent`, for these jobs and `wake`). `commit`: the caller's durable transaction
    ends with these writes, and its COMMIT goes with the last (telemachus/db/pipeline.py)."""
    if not ends:
        return
    started = (freed or slots_free_sent(job_ids=[end.job.pk for end in ends], wake=wake))()
    bills = [
        Bill(
            team_id=end.job.team_id,
            user_id=end.job.user_id,
            executor_id=end.job.executor_id,
            tokens=end.tokens,
            cost=end.cost,
            model=end.model or end.job.model,
            key_id=end.job.key_id,
            prompt_tokens=end.prompt_tokens,
            completion_tokens=end.completion_tokens,
        )
        for end in ends
        if end.tokens is not None
    ]
    quota_settle(reservations=[end.reservation for end in ends], bills=bills, now=now, rules=rules)
    charges: defaultdict[int, float] = defaultdict(float)
    for end in ends:
        end.job.reservation_released()
        began = started.get(end.job.pk)
        if end.charge and began is not None:
            charges[end.job.team_id] += attempt_cost(
                record, started_at=began, now=now, tokens=end.tokens or 0, estimate=end.job.cost_estimate
            )
    with committing() if commit else nullcontext():
        team_shares_charge(charges=charges, now=now, half_life=record.half_life_seconds)


def slots_free_sent(*, job_ids: Sequence[int], wake: bool = False) -> Callable[[], dict[int, datetime]]:
    """Delete the jobs' slots in one statement, executed now; calling the result reads when each
    job's attempt began (its first slot's `acquired_at`), so inside telemachus.db.pipeline.together()
    the DELETE goes with the block's other statements (the finish sends it with its jobs' end). A
    job that held no slot (a tool job) is absent from the answer. `wake`: the same statement tells
    the workers that slots were freed, if any was (`notify.FREED`, once per transaction, as
    PostgreSQL delivers identical notifications of one transaction once): a round trip fewer on
    every finish."""
    if not job_ids:
        return dict
    told = (
        Riders(notices=[notice(notify.WORKERS_CHANNEL, [notify.FREED])]) if wake and notices_supported() else NO_RIDERS
    )
    deleted = delete_sent(Slot, field="job", values=job_ids, returning=("job", "acquired_at", "id"), riders=told)
    return lambda: _began(deleted())


def _began(rows: Sequence[tuple[Any, ...]]) -> dict[int, datetime]:
    """Each job's first slot's `acquired_at` (the lowest slot id) from the DELETE's rows."""
    return {row[0]: row[1] for row in sorted(rows, key=lambda row: row[2], reverse=True)}


def attempt_cost(
    record: QueuePolicy, *, started_at: datetime | None, now: datetime, tokens: int, estimate: int
) -> float:
    """What an attempt adds to its team's fair-share usage when it ends: its real cost (slot-seconds
    or tokens) less the entry penalty charged when it started. The penalty only holds a burst back
    until the real cost is known; history keeps the real cost alone."""
    if record.cost == QueuePolicy.Cost.TOKENS:
        return tokens - estimate
    return max((now - (started_at or now)).total_seconds(), 0.0) - float(record.entry_penalty)
