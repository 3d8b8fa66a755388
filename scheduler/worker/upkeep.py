"""What a worker does beside its jobs, each a loop of its own on the worker's claim thread:

  recovery   requeues or fails jobs whose lease expired (at start and every half lease), so a
             worker or an API process that died gives its jobs back.
  probes     checks executors' health (GET /models), each executor by one worker per interval.
  history    as each bucket closes, records the dashboard's history (the first worker to get
             there writes it, scheduler/services/history.py).
  batches    feeds the batches under way into the queue and ends those done
             (scheduler/batches/feeder.py), on a database thread of its own.
  webhooks   sends the webhooks' outbox (telemachus/webhooks/delivery.py), on a database thread
             of its own: an attempt waits on a receiver for up to its timeout, and nothing else
             of the worker waits behind it.
  retention  deletes what ended longer ago than its retention, and removes prompts and answers
             past theirs (scheduler/services/retention.py), every TELEMACHUS_PRUNE_INTERVAL_SECONDS,
             in small batches, on a database thread of its own: a backlog never delays a claim.

A failure is logged and the loop goes on: none of them holds a job."""

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from django.db import DatabaseError

from executors.contract import Probe
from executors.health import probe_record, probes_due
from executors.models import Executor
from executors.registry import DriverPool
from scheduler.batches.feeder import batches_advance
from scheduler.connections import database_call, database_thread, database_thread_close
from scheduler.metrics import rows_pruned_observe
from scheduler.services.history import history_next_in, history_record
from scheduler.services.recover import jobs_recover
from scheduler.services.retention import prune_once
from scheduler.worker.host import pooled_driver
from telemachus.webhooks.delivery import webhooks_deliver

log = logging.getLogger("telemachus.worker")
DbCall = Callable[..., Awaitable[Any]]
# The most webhook deliveries one call sends; a call that finds as many goes again at once.
WEBHOOK_BATCH = 32


async def recover_once(*, db: DbCall, recovered: Callable[[], None]) -> None:
    """Recover expired leases once; `recovered` is told when jobs went back to the queue or ended."""
    try:
        report = await db(jobs_recover)
    except DatabaseError as exc:
        log.warning("recovery failed (%s)", exc)
        return
    if report.requeued or report.failed:
        log.info("recovered expired leases: requeued %s, failed %s", report.requeued, report.failed)
        recovered()


async def recovery(*, db: DbCall, lease_seconds: float, recovered: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(max(lease_seconds / 2, 1.0))
        await recover_once(db=db, recovered=recovered)


async def history(*, db: DbCall) -> None:
    while True:
        await asyncio.sleep(history_next_in())
        try:
            await db(history_record)
        except DatabaseError as exc:
            log.warning("recording the dashboard's history failed (%s)", exc)


async def probes(*, db: DbCall, drivers: DriverPool) -> None:
    interval = settings.TELEMACHUS_PROBE_INTERVAL_SECONDS
    while True:
        try:
            due = await db(probes_due, interval=interval)
            if due:
                results = await asyncio.gather(*(_probe(executor, drivers) for executor in due))
                for event in await db(probe_record, results=results):
                    log.warning(
                        "executor %s: health %s -> %s (%s)",
                        event.meta["executor_name"],
                        event.meta["was"],
                        event.meta["health"],
                        event.meta["detail"],
                    )
        except DatabaseError as exc:
            log.warning("probing failed (%s)", exc)
        await asyncio.sleep(min(interval, 5.0))


async def _probe(executor: Executor, drivers: DriverPool) -> tuple[int, Probe]:
    try:
        return executor.pk, await asyncio.wait_for(pooled_driver(drivers, executor).probe(), timeout=30)
    except Exception as exc:  # a probe that crashes says the executor cannot be trusted
        return executor.pk, Probe(health=Executor.Health.DOWN, detail=f"probe error: {exc!r}")


async def webhooks() -> None:
    """Send the webhooks' outbox: again at once while a call finds as many as it takes, else after
    TELEMACHUS_WEBHOOKS_POLL_SECONDS."""
    thread = database_thread("telemachus-webhooks")
    try:
        while True:
            taken = 0
            try:
                taken = await database_call(thread, webhooks_deliver, limit=WEBHOOK_BATCH)
            except Exception:  # the outbox keeps what was not sent: log, and go on
                log.exception("delivering webhooks failed")
            if taken < WEBHOOK_BATCH:
                await asyncio.sleep(settings.TELEMACHUS_WEBHOOKS_POLL_SECONDS)
    finally:
        await asyncio.shield(database_thread_close(thread))


async def retention() -> None:
    """Prune every TELEMACHUS_PRUNE_INTERVAL_SECONDS. Every worker does, each taking batches the
    others do not hold (SKIP LOCKED); a pass drains what is due, batch after batch, so a worker
    catches up with a backlog while it serves, and each batch is a transaction of its own."""
    thread = database_thread("telemachus-retention")
    # Set when the worker stops: the pass on the thread ends after its batch under way.
    stopping = threading.Event()
    try:
        while True:
            await asyncio.sleep(settings.TELEMACHUS_PRUNE_INTERVAL_SECONDS)
            try:
                report = await database_call(
                    thread, prune_once, pace=settings.TELEMACHUS_PRUNE_PACE, more=lambda: not stopping.is_set()
                )
            except Exception:  # nothing is lost: what is due now is due at the next pass
                log.exception("retention failed")
                continue
            rows_pruned_observe(report.counts)
            if report.total:
                log.info("retention: %s", ", ".join(f"{table} {n}" for table, n in report.counts.items()))
    finally:
        stopping.set()
        await asyncio.shield(database_thread_close(thread))


async def batches() -> None:
    """Feed the batches under way and end those done (scheduler/batches/feeder.py), on a database
    thread of its own: again at once while a pass moves something, else after
    TELEMACHUS_BATCH_FEED_SECONDS."""
    thread = database_thread("telemachus-batches")
    try:
        while True:
            moved = 0
            try:
                moved = await database_call(thread, batches_advance)
            except Exception:  # the batches are rows: the next pass starts from them again
                log.exception("advancing batches failed")
            if not moved:
                await asyncio.sleep(settings.TELEMACHUS_BATCH_FEED_SECONDS)
    finally:
        await asyncio.shield(database_thread_close(thread))
