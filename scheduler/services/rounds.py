"""Rounds: a flow holds a slot only while one model call runs, and so does app code that runs its
own model call in a governed slot (scheduler/flows/governed.py).

A round is a claim like any job's (job_claim: priority, fair share, the four caps, budgets,
placement), then:

  round_begin     the holder reads the conversation so far; event `round_started`. A flow's claim
                  does both itself (`round_claimed`), so its holder calls this only when the
                  last round's tool calls have no results yet, and a governed slot's holder always.
  round_finish    after the model call: the slot is freed and the round billed (tokens to the job
                  and the usage ledger, real cost to fair share), event `round_finished` with the
                  tokens and the tools called. A flow whose model answered without tool calls is
                  done; one that called tools past `max_rounds` fails; otherwise it stays running,
                  with no slot, while its holder runs the tools. A governed slot is done.
  round_requeue   the tool results join the conversation and the flow goes back to the queue for
                  its next round, as new work (QueuePolicy.flow_rounds), preferring the executor
                  that served this round (QueuePolicy.affinity); a failed tool fails it.
  rounds_end      both of the last two in one transaction, for rounds whose tools their holder
                  ran before writing the round's end (quick tools: scheduler/flows/runner.py),
                  several flows' rounds at once (a worker batches them; `round_end` for one).

All three are fenced like a job's finish: they name the job, its lease and the round, and are
refused (LeaseLost) unless that lease still holds the job at that round. So a round is billed once:
a worker that dies mid-call never finishes its round (recovery requeues the flow and the round runs
again, its reservation released and nothing billed); one that dies after `round_finish` left the
round's tool calls in the conversation without results, and the next claim runs those tools (its
slot given straight back) instead of calling the model again. Earlier rounds are never repeated:
their messages are in `Job.conversation`, written in the transaction that ends them.
"""

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.db import transaction

from executors.models import Executor
from executors.tools import ToolOutcome
from scheduler.core.configuration import configuration, policy_record, queue_policy
from scheduler.core.estimates import round_estimate
from scheduler.core.locks import lock_job, lock_jobs_versioned
from scheduler.core.money import token_split_estimate
from scheduler.models import Job, JobEvent, QueuePolicy
from scheduler.services.attempts import AttemptEnd, attempts_end
from scheduler.services.events import events_record, events_riders, job_event
from scheduler.webhooks import jobs_failed_emit
from telemachus.control import notify
from telemachus.control.config import config_at, config_snapshot
from telemachus.control.features import feature_on
from telemachus.db.changes import rows_save
from telemachus.errors import Conflict

if TYPE_CHECKING:
    from scheduler.core.locks import ClockedJob

DEFAULT_MAX_ROUNDS, MAX_ROUNDS = 20, 200


class LeaseLost(Conflict):
    """The caller no longer holds the job at this round: it must stop working on it."""

    default_detail = "The job's lease is no longer held by this worker."


@dataclass(frozen=True)
class RoundStart:
    """What the holder of a round needs: its number and the conversation so far. With `pending`,
    the previous round's tool calls never got their results (their worker died): the slot has been
    given back already, and the holder runs those tools, then `round_requeue(round=round)`, and
    makes no model call."""

    round: int
    messages: list[dict[str, Any]]
    pending: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class RoundEnd:
    """How a round ended: the job's status now, and for a flow still running, the tool calls its
    holder must run before `round_requeue`."""

    status: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tools_to_run(self) -> bool:
        return self.status == Job.Status.RUNNING


def pending_tool_calls(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls of the last round whose results are not in the conversation yet (each
    result is recorded as its tool ends: `round_tool_record`)."""
    for at in range(len(conversation) - 1, -1, -1):
        message = conversation[at]
        if message.get("role") == "assistant":
            answered = {m.get("tool_call_id") for m in conversation[at + 1 :]}
            return [call for call in message.get("tool_calls") or [] if call.get("id") not in answered]
        if message.get("role") != "tool":
            return []
    return []


def _awaiting_results(conversation: list[dict[str, Any]]) -> bool:
    """The conversation ends with a round's tool calls, and maybe some of their results, and not
    yet the next round's: the flow is between its round's end and its requeue."""
    tail = next((m for m in reversed(conversation) if m.get("role") != "tool"), None)
    return tail is not None and tail.get("role") == "assistant" and bool(tail.get("tool_calls"))


def tool_names(calls: list[dict[str, Any]]) -> list[str]:
    return [str((call.get("function") or {}).get("name", "")) for call in calls]


def _held(job_id: int, lease: uuid.UUID, *, rounds: int | None = None) -> "ClockedJob":
    """Lock the job (level 3) if `lease` still holds it, and it has finished `rounds` rounds."""
    job = lock_job(job_id)
    if job is None:
        raise LeaseLost(f"Lease {lease} no longer holds job {job_id} (gone).")
    lost = _lost(job, lease, rounds=rounds)
    if lost is not None:
        raise LeaseLost(lost)
    return job


def _lost(job: "ClockedJob", lease: uuid.UUID, *, rounds: int | None) -> str | None:
    """Why `lease` no longer holds the locked job with `rounds` rounds finished, or None."""
    if job.status != Job.Status.RUNNING or job.lease != lease or _expired(job):
        return f"Lease {lease} no longer holds job {job.pk} ({job.status})."
    if rounds is not None and job.rounds != rounds:
        return f"Job {job.pk} has finished {job.rounds} rounds, not {rounds}: this round was recorded."
    return None


def _expired(job: "ClockedJob") -> bool:
    return job.lease_expires_at is None or job.lease_expires_at <= job.db_now


def round_claimed(job: Job) -> RoundStart | None:
    """The round a flow's claim started, read from the claimed job (its conversation as the claim
    read it): the claim recorded its `round_started` (`round_started_event`), so the holder goes
    straight to the model call, with no transaction of its own. None when the last round's tool
    calls have no results: the holder calls `round_begin`, which handles that."""
    if job.type != Job.Type.FLOW or pending_tool_calls(job.conversation):
        return None
    return RoundStart(round=job.rounds + 1, messages=[*(job.input.get("messages") or []), *job.conversation])


def round_started_event(job: Job, *, at: datetime) -> JobEvent:
    """The `round_started` event of the job's next round (unsaved)."""
    return job_event(
        job=job,
        event=JobEvent.Type.ROUND_STARTED,
        at=at,
        round=job.rounds + 1,
        executor=job.executor_id,
        worker=job.worker,
        attempt=job.attempts,
    )


def round_begin(*, job_id: int, lease: uuid.UUID) -> RoundStart:
    """Start the claimed round of a flow or governed slot: the conversation so far (the input's
    messages, then what earlier rounds added) and event `round_started`.

    When the last round's tool calls have no results (the worker that ran them died), this claim
    makes no model call: its slot is freed and its reservation released at once, and the caller
    runs the tools. Durable; locks the job (level 3), then ledger and shares when it frees the
    slot. Raises LeaseLost when `lease` no longer holds the job."""
    record = queue_policy()
    with transaction.atomic(durable=True):
        job = _held(job_id, lease)
        messages = [*(job.input.get("messages") or []), *job.conversation]
        pending = pending_tool_calls(job.conversation)
        now = job.db_now
        if pending:
            event = job_event(
                job=job,
                event=JobEvent.Type.STEP,
                at=now,
                action="tools_resumed",
                round=job.rounds,
                tools=tool_names(pending),
            )
            events_record([event])
            attempts_end(ends=[AttemptEnd.of(job, tokens=None)], now=now, record=record, wake=True)
            rows_save([job])
            return RoundStart(round=job.rounds, messages=messages, pending=pending)
        events_record([round_started_event(job, at=now)])
        return RoundStart(round=job.rounds + 1, messages=messages)


def round_finish(
    *,
    job_id: int,
    lease: uuid.UUID,
    round: int,
    message: dict[str, Any] | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    error: str = "",
    meta: dict[str, Any] | None = None,
) -> RoundEnd:
    """End round `round` after its model call: free the slot and bill the round, event
    `round_finished` (tokens, and the names of the tools the model called).

    A flow appends the assistant `message` to its conversation, then ends `done` with
    `result = {message, rounds, tokens}` when the message has no tool calls, or `failed` with
    error "max_rounds" when it calls tools in its last allowed round; otherwise it stays running
    under the same lease, with no slot, for its holder to run the tools. A governed slot ends
    `done` (or `failed` with the caller's `error`) with the tokens it reported.

    Durable; locks the job (level 3), then ledger rows (4) and team shares (5). Raises LeaseLost
    unless `lease` holds the job at round `round` (so a round is never billed twice)."""
    record = queue_policy()
    with transaction.atomic(durable=True):
        job = _held(job_id, lease, rounds=round - 1)
        events: list[JobEvent] = []
        attempt = _round_close(
            job,
            round=round,
            message=message,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            error=error,
            meta=meta,
            executor=Executor.objects.filter(pk=job.executor_id).only("prices").first() if job.executor_id else None,
            events=events,
        )
        # Under `continue` the flow keeps its place while its tools run: a slot freed now is not
        # advertised, so the flow's next round (queued when the tools are done) normally takes it
        # rather than newer work of its team; a claim woken by something else may still use it.
        goes_on = job.status == Job.Status.RUNNING and record.flow_rounds == QueuePolicy.FlowRounds.CONTINUE
        attempts_end(ends=[attempt], now=job.db_now, record=record, wake=not goes_on)
        rows_save([job], riders=events_riders(events))
    return RoundEnd(
        status=job.status,
        tool_calls=list(pending_tool_calls(job.conversation)) if job.status == Job.Status.RUNNING else [],
    )


@dataclass(frozen=True)
class RoundOutcome:
    """A flow's round whose model call answered and whose tool calls (if it made any) ran: what
    `rounds_end` writes, fenced by the job, its lease and the round."""

    job_id: int
    lease: uuid.UUID
    round: int
    message: dict[str, Any]
    results: list[ToolOutcome] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def round_end(
    *,
    job_id: int,
    lease: uuid.UUID,
    round: int,
    message: dict[str, Any],
    results: list[ToolOutcome],
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    meta: dict[str, Any] | None = None,
) -> str:
    """One round's `rounds_end`; returns the job's status. Raises LeaseLost unless `lease` holds
    the job at round `round`."""
    end = RoundOutcome(
        job_id=job_id,
        lease=lease,
        round=round,
        message=message,
        results=results,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        meta=meta or {},
    )
    written = rounds_end(ends=[end])
    if job_id not in written:
        raise LeaseLost(f"Lease {lease} no longer holds job {job_id} at round {round}.")
    return written[job_id]


def rounds_end(*, ends: Sequence[RoundOutcome], wake_others: bool = True) -> dict[int, str]:
    """`round_finish` and `round_requeue` in one transaction, for flows' rounds whose tool calls
    their holder ran before writing the rounds' ends (they were quick: scheduler/flows/runner.py),
    several rounds at once (a worker batches the rounds that end while it writes), so a round
    costs a share of one write besides its claim. What is written for each is what the two would
    write one after the other: the round billed and its slot freed (`round_finished`), the tool
    results in the conversation, the flow queued for its next round (`queued`, preferring the
    executor that served this one) or ended (done, max_rounds, a failed tool).

    `wake_others`: tell the workers at commit (slots freed, rounds queued). A worker that will
    claim at once with the capacity it freed says False, as its finishes do, so one claim, not one
    per worker, answers a round's end.

    Durable; locks the jobs (level 3, ascending id), then ledger rows (4) and team shares (5).
    Returns job id -> status for the rounds written; a round whose lease no longer holds its job
    at that round is left out (refused), never billed twice."""
    with transaction.atomic(durable=True):
        locked = {job.pk: job for job in lock_jobs_versioned(sorted({end.job_id for end in ends}))}
        if not locked:
            return {}
        # The policy, prices and quota rules as cached for the configuration version read with
        # the locks: no statement of their own.
        snapshot = config_at(next(iter(locked.values())).config_version)
        record, config = policy_record(snapshot), configuration(snapshot)
        executors = {e.pk: e for e in config.executors}
        closed: list[tuple[ClockedJob, RoundOutcome]] = []
        attempts: list[AttemptEnd] = []
        events: list[JobEvent] = []
        for end in ends:
            job = locked.pop(end.job_id, None)
            if job is None or _lost(job, end.lease, rounds=end.round - 1) is not None:
                continue
            attempt = _round_close(
                job,
                round=end.round,
                message=end.message,
                prompt_tokens=end.prompt_tokens,
                completion_tokens=end.completion_tokens,
                meta=end.meta,
                executor=executors.get(job.executor_id) if job.executor_id else None,
                events=events,
            )
            attempts.append(attempt)
            closed.append((job, end))
        if not closed:
            return {}
        # The rounds billed as they ended (their estimates, before the next rounds' replace them).
        attempts_end(ends=attempts, now=closed[0][0].db_now, record=record, wake=False, rules=config.rules)
        for held, end in closed:
            if held.status == Job.Status.RUNNING:
                _round_requeue(
                    held,
                    record,
                    round=end.round,
                    results=end.results,
                    events=events,
                    wake=False,
                    features=config.features,
                )
        # One statement per set of fields changed (rounds requeued, flows ended), not one per job.
        rows_save([job for job, _ in closed], riders=events_riders(events))
        statuses = {job.pk: str(job.status) for job, _ in closed}
        if wake_others:
            if Job.Status.QUEUED in statuses.values():
                notify.notify_workers(notify.QUEUED)
            if any(status != Job.Status.QUEUED for status in statuses.values()):
                notify.notify_workers(notify.FREED)
        return statuses


def _round_close(
    job: Job,
    *,
    round: int,
    message: dict[str, Any] | None,
    prompt_tokens: int,
    completion_tokens: int,
    meta: dict[str, Any] | None,
    executor: Executor | None,
    events: list[JobEvent],
    error: str = "",
) -> AttemptEnd:
    """The end of a locked job's round (see `round_finish`), not saved and not yet settled: the
    round's attempt (for the caller's `attempts_end`); its events are appended to `events`.
    `executor` prices the tokens."""
    tokens = prompt_tokens + completion_tokens
    now = cast("ClockedJob", job).db_now
    attempt = AttemptEnd.of(
        job, tokens=tokens, executor=executor, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
    )
    total = (job.tokens_used or 0) + tokens
    job.round_closed(round=round, message=message)
    calls = list((message or {}).get("tool_calls") or []) if job.type == Job.Type.FLOW else []
    events.append(
        job_event(
            job=job,
            event=JobEvent.Type.ROUND_FINISHED,
            at=now,
            round=round,
            tokens=tokens,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            tools=tool_names(calls),
            executor=job.executor_id,
            **(meta or {}),
        )
    )
    if job.type == Job.Type.FLOW:
        max_rounds = int(job.input.get("max_rounds") or DEFAULT_MAX_ROUNDS)
        if not calls:
            result = {"message": message, "rounds": round, "tokens": total}
            events.append(_end(job, status=Job.Status.DONE, now=now, result=result, tokens=tokens, rounds=round))
        elif round >= max_rounds:
            events.append(
                _end(
                    job,
                    status=Job.Status.FAILED,
                    now=now,
                    error="max_rounds",
                    tokens=tokens,
                    rounds=round,
                    max_rounds=max_rounds,
                )
            )
    elif error:
        events.append(_end(job, status=Job.Status.FAILED, now=now, error=error, tokens=tokens))
    else:
        result = {"tokens": tokens, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        events.append(_end(job, status=Job.Status.DONE, now=now, result=result, tokens=tokens))
    if job.status == Job.Status.RUNNING:
        job.tokens_add(tokens)
    return attempt


def _end(
    job: Job,
    *,
    status: str,
    now: datetime,
    result: dict[str, Any] | None = None,
    error: str = "",
    tokens: int = 0,
    **meta: Any,
) -> JobEvent:
    """End the job (`Job.end`, not saved), its last attempt having used `tokens`, and return its
    `finished` or `failed` event, which names the job's tokens in all."""
    job.end(status=status, at=now, result=result, error=error, tokens=tokens)
    jobs_failed_emit(jobs=[job])
    event = JobEvent.Type.FINISHED if status == Job.Status.DONE else JobEvent.Type.FAILED
    return job_event(
        job=job,
        event=event,
        at=now,
        executor=job.executor_id,
        **({"error": error} if error else {}),
        **({"tokens": job.tokens_used} if job.type == Job.Type.FLOW else {"tokens": tokens}),
        **meta,
    )


def _tool_message(result: ToolOutcome) -> dict[str, Any]:
    content = result.content if result.ok else json.dumps({"error": result.content})
    return {"role": "tool", "tool_call_id": result.call_id, "content": content}


def round_tool_record(*, job_id: int, lease: uuid.UUID, round: int, result: ToolOutcome) -> bool:
    """Record one tool call's result of round `round` as soon as its tool ends, while the other
    calls of the round still run: a worker that dies now leaves it recorded, and the claim that
    picks the flow up runs only the calls still without a result (`pending_tool_calls`). A
    failure is recorded only when the flow's input says `return_tool_errors` (otherwise it fails
    the flow in `round_requeue`). Returns whether it recorded the result (False: already there,
    not a call of this round, or a failure left to the requeue).

    Durable; locks the job (level 3). Raises LeaseLost unless `lease` holds the job at round
    `round`'s end."""
    with transaction.atomic(durable=True):
        job = _held(job_id, lease, rounds=round)
        waiting = {call.get("id") for call in pending_tool_calls(job.conversation)}
        if result.call_id not in waiting or not (result.ok or job.input.get("return_tool_errors")):
            return False
        job.tool_results_added([_tool_message(result)])
        rows_save([job])
        return True


def round_requeue(*, job_id: int, lease: uuid.UUID, round: int, results: list[ToolOutcome]) -> str:
    """After round `round`'s tools ran: their results join the conversation (`role: tool`
    messages, in call order; those recorded already as they ended are not added twice) and the
    flow goes back to the queue for round `round + 1`, as new work: ready now under
    QueuePolicy.flow_rounds = requeue (behind what became ready while it ran), keeping its place
    under `continue`; either way its wait, for aging, starts now and its next round gets fresh
    attempts, and prefers the executor that served this round (`affinity_executor`,
    QueuePolicy.affinity). Event `queued` with each tool's name, time and outcome.

    A failed tool call fails the flow with the tool's error, unless the flow's input says
    `return_tool_errors`, in which case the error goes back to the model as that call's result.

    Durable; locks the job (level 3). Returns the job's status. Raises LeaseLost unless `lease`
    holds the job with round `round`'s tool calls still waiting for results."""
    snapshot = config_snapshot()
    record, features = policy_record(snapshot), configuration(snapshot).features
    with transaction.atomic(durable=True):
        job = _held(job_id, lease, rounds=round)
        if not _awaiting_results(job.conversation):
            raise LeaseLost(f"Job {job_id} has no tool calls waiting in round {round}.")
        events: list[JobEvent] = []
        _round_requeue(job, record, round=round, results=results, events=events, wake=True, features=features)
        rows_save([job], riders=events_riders(events))
        return str(job.status)


def _round_requeue(
    job: "ClockedJob",
    record: QueuePolicy,
    *,
    round: int,
    results: list[ToolOutcome],
    events: list[JobEvent],
    wake: bool,
    features: Mapping[tuple[str, int | None], bool],
) -> None:
    """Record a locked flow's tool results and queue its next round, or fail it (see
    `round_requeue`), not saved: appends the event to `events`, and with `wake` wakes the workers
    at commit when the flow is queued. A flow whose feature was switched off for its team since
    it started (`features`: the switches as cached) stops here, at its round boundary, canceled
    as a cancel would leave it: its rounds so far billed, its results kept in the conversation."""
    now = job.db_now
    waiting = {call.get("id") for call in pending_tool_calls(job.conversation)}
    job.tool_results_added([_tool_message(r) for r in results if r.call_id in waiting])
    tools = [r.describe() for r in results]
    failure = next((r for r in results if not r.ok), None)
    if failure is not None and not job.input.get("return_tool_errors"):
        events.append(_end(job, status=Job.Status.FAILED, now=now, error=failure.content, rounds=round, tools=tools))
        return
    if not feature_on(feature=Job.Type.FLOW, team_id=job.team_id, switches=features):
        reason = "the flow feature was switched off for its team; stopped at a round boundary"
        job.end(status=Job.Status.CANCELED, at=now, error=reason)
        events.append(
            job_event(job=job, event=JobEvent.Type.CANCELED, at=now, reason=reason, rounds=round, tools=tools)
        )
        return
    # The next round's prompt holds the whole conversation: its budgets reserve that.
    estimate = round_estimate(job)
    prompt, completion = token_split_estimate(
        type=job.type,
        requirements=job.requirements,
        input={**job.input, "messages": [*(job.input.get("messages") or ()), *job.conversation]},
        estimate=estimate,
    )
    job.next_round(
        now=now,
        keep_place=record.flow_rounds == QueuePolicy.FlowRounds.CONTINUE,
        estimate=estimate,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )
    events.append(
        job_event(
            job=job, event=JobEvent.Type.QUEUED, at=now, round=round + 1, tools=tools, flow_rounds=record.flow_rounds
        )
    )
    if wake:
        notify.notify_workers(notify.QUEUED)
