"""Executor health: the passive circuit breaker fed by dispatch outcomes, and the active probe.

Both live in the database, so every worker and API process sees the same state: an executor that
fails K times in a row (connection refused or reset, timeout, 5xx) is taken out of placement for a
cooldown, then the claim lets one trial request through (half open); its outcome closes the breaker
or opens it again. Each transition is a job-independent event. Probes (GET /models) set `health`
and `last_seen`; a `down` executor is not placed.

Transactions here lock executor rows only (lock level 2, see scheduler/core/locks.py), never job rows,
so they run after the finish that produced the outcomes, not inside it.

The events are stored by whoever installs a recorder (`events_recorder_install`; the scheduler
writes them as job-less JobEvent rows), so this module does not know where they go."""

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from executors.contract import Probe
from executors.models import Executor
from executors.webhooks import executor_events_emit
from telemachus.control.notify import changes_notify
from telemachus.db.locks import Level, rows_lock

BREAKER_OPENED, BREAKER_HALF_OPEN, BREAKER_CLOSED = "breaker_opened", "breaker_half_open", "breaker_closed"
HEALTH_CHANGED = "health_changed"


@dataclass(frozen=True)
class ExecutorEvent:
    """A breaker transition or health change of one executor, at the database time it happened."""

    executor_id: int
    event: str
    at: datetime
    meta: dict[str, object]


EventsRecorder = Callable[[Sequence[ExecutorEvent]], None]
_recorder: EventsRecorder | None = None


def events_recorder_install(recorder: EventsRecorder) -> None:
    """Set where executor events are stored, in the transaction of the change they describe (the
    scheduler installs one when its app is ready)."""
    global _recorder
    _recorder = recorder


def events_record(events: Sequence[ExecutorEvent]) -> None:
    """Store the events through the installed recorder, and put those a team acts on (down, up,
    breaker opened) in its webhooks' outbox (executors/webhooks.py), in the caller's transaction.
    Without a recorder (the scheduler app is not installed or not ready) nothing can store them:
    that is a deployment error, raised, never an event dropped unseen."""
    if not events:
        return
    if _recorder is None:
        raise RuntimeError(f"executor events with no recorder installed (scheduler app not ready): {events!r}")
    _recorder(events)
    executor_events_emit(events)


@dataclass(frozen=True)
class DispatchReport:
    """How one dispatch ended, as far as the executor's breaker is concerned."""

    executor_id: int
    ok: bool
    executor_fault: bool = False


# When this process last stamped each executor's `last_seen` from a dispatch that found its breaker
# closed with no failure counted (time.monotonic(), by executor id).
_last_seen_stamped: dict[int, float] = {}
LAST_SEEN_EVERY = 1.0  # seconds


def breaker_quiet(*, reports: Sequence[DispatchReport], clean: Collection[int] = ()) -> bool:
    """Whether `breaker_record` would write nothing for these reports (see its `clean`): no report,
    or only answers from executors the finish saw clean whose `last_seen` this process stamped
    within LAST_SEEN_EVERY. No query, so a caller that hands the record to a database thread can
    ask first and skip the hop: the usual case for every call on a busy executor."""
    if not reports:
        return True
    if not all(r.ok or not r.executor_fault for r in reports):
        return False
    answered = {r.executor_id for r in reports}
    now = time.monotonic()
    return answered.issubset(clean) and all(
        now - _last_seen_stamped.get(pk, float("-inf")) < LAST_SEEN_EVERY for pk in answered
    )


def breaker_record(*, reports: Sequence[DispatchReport], clean: Collection[int] = ()) -> list[ExecutorEvent]:
    """Apply dispatch outcomes to the executors' breakers, in order; returns the events written.

    A success (or a failure that is the request's fault, like a 400: the server answered) resets
    the count and closes an open or half-open breaker. An executor fault counts; the K-th in a row
    opens a closed breaker, and any fault reopens a half-open one (the trial failed).

    `clean`: executors the caller saw, in the finish of these dispatches (`FinishReport.clean`),
    with their breaker closed and no failure counted. When every report is an answer from such an
    executor, the only thing left to write is `last_seen`, which this process stamps at most once
    every LAST_SEEN_EVERY seconds per executor: a call on a busy executor then costs no statement
    and no commit here. A fault is always written at once, and a success from an executor the
    finish did not see clean (a count to reset, a half-open breaker to close) too; what the skip
    can miss is a failure another process records between the finish's read and this call, a
    moment as long as the existing one between a dispatch's end and its report."""
    if breaker_quiet(reports=reports, clean=clean):
        return []
    if all(r.ok or not r.executor_fault for r in reports):
        # The usual case, every server answered and no breaker to reset: one statement, no lock.
        answered = {r.executor_id for r in reports}
        started = time.monotonic()
        closed = Executor.objects.filter(pk__in=answered, breaker=Executor.Breaker.CLOSED, consecutive_failures=0)
        if closed.update(last_seen=Now()) == len(answered):
            _last_seen_stamped.update(dict.fromkeys(answered, started))
            return []
    threshold = settings.TELEMACHUS_BREAKER_THRESHOLD
    cooldown = timedelta(seconds=settings.TELEMACHUS_BREAKER_COOLDOWN_SECONDS)
    with transaction.atomic(durable=True):
        executors = {
            e.pk: e
            for e in rows_lock(Executor.objects, level=Level.EXECUTOR)
            .filter(pk__in=sorted({r.executor_id for r in reports}))
            .annotate(db_now=Now())
            .order_by("pk")
        }
        events, changed = [], set()
        for report in reports:
            executor = executors.get(report.executor_id)
            if executor is None:
                continue
            now = executor.db_now
            if report.ok or not report.executor_fault:
                executor.last_seen = now
                changed.add(executor.pk)
                if executor.consecutive_failures or executor.breaker != Executor.Breaker.CLOSED:
                    was = executor.breaker
                    executor.consecutive_failures = 0
                    executor.breaker, executor.breaker_until = Executor.Breaker.CLOSED, None
                    if was != Executor.Breaker.CLOSED:
                        events.append(_event(executor, BREAKER_CLOSED, now, was=was))
                continue
            executor.consecutive_failures += 1
            changed.add(executor.pk)
            trial_failed = executor.breaker == Executor.Breaker.HALF_OPEN
            if trial_failed or (
                executor.breaker == Executor.Breaker.CLOSED and executor.consecutive_failures >= threshold
            ):
                executor.breaker, executor.breaker_until = Executor.Breaker.OPEN, now + cooldown
                events.append(
                    _event(
                        executor,
                        BREAKER_OPENED,
                        now,
                        failures=executor.consecutive_failures,
                        until=executor.breaker_until.isoformat(),
                        trial_failed=trial_failed,
                    )
                )
        for pk in changed:
            executors[pk].save(update_fields=["last_seen", "breaker", "breaker_until", "consecutive_failures"])
        events_record(events)
        if events:
            changes_notify("breaker")
    return events


def last_seen_stamps_forget() -> None:
    """Forget when `last_seen` was stamped (tests: a new database may reuse an executor's id)."""
    _last_seen_stamped.clear()


def breaker_trial_started(*, executor: Executor, now: datetime) -> None:
    """open → half open, when the claim places the one trial request after the cooldown.
    Runs inside the claim, after the claim lock (level 1) and before job rows (level 3). Leaves
    `executor` as it is: the claim's executors are shared configuration (the row's change bumps
    the configuration version, so the next claim reads it again)."""
    if Executor.objects.filter(pk=executor.pk, breaker=Executor.Breaker.OPEN).update(
        breaker=Executor.Breaker.HALF_OPEN
    ):
        events_record([_event(executor, BREAKER_HALF_OPEN, now)])
        changes_notify("breaker")


def probes_due(*, interval: float) -> list[Executor]:
    """Take the enabled executors whose last probe is older than `interval`. Each is marked probed
    by an UPDATE that repeats the due condition, so among many workers exactly one gets each: a
    concurrent UPDATE re-checks the condition after the first commits and matches nothing."""
    due_condition = Q(last_probed_at__isnull=True) | Q(last_probed_at__lte=Now() - timedelta(seconds=interval))
    taken = []
    for executor in Executor.objects.filter(due_condition, enabled=True).order_by("pk"):
        if Executor.objects.filter(due_condition, pk=executor.pk).update(last_probed_at=Now()):
            taken.append(executor)
    return taken


def probe_record(*, results: Sequence[tuple[int, Probe]]) -> list[ExecutorEvent]:
    """Store what probes saw: `health`, and `last_seen` when the executor answered. A change of
    health is an event."""
    events = []
    with transaction.atomic(durable=True):
        for executor in (
            rows_lock(Executor.objects, level=Level.EXECUTOR)
            .filter(pk__in=sorted(pk for pk, _ in results))
            .annotate(db_now=Now())
            .order_by("pk")
        ):
            probe = dict(results)[executor.pk]
            fields = ["health"]
            if probe.health != Executor.Health.DOWN:
                executor.last_seen = executor.db_now
                fields.append("last_seen")
            if probe.health != executor.health:
                events.append(
                    _event(
                        executor,
                        HEALTH_CHANGED,
                        executor.db_now,
                        was=executor.health,
                        health=probe.health,
                        detail=probe.detail,
                        latency_ms=probe.latency_ms,
                    )
                )
            executor.health = probe.health
            executor.save(update_fields=fields)
        events_record(events)
        if events:
            changes_notify("health")
    return events


def _event(executor: Executor, event: str, at: datetime, **meta: object) -> ExecutorEvent:
    return ExecutorEvent(executor_id=executor.pk, event=event, at=at, meta={"executor_name": executor.name, **meta})
