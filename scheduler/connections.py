"""Where the scheduler's asyncio code runs its database calls: on threads, never on the event loop
(Django's database API blocks). Two kinds, and what counts as an outage for both.

* The shared threads (`db`): a few threads per API process (TELEMACHUS_GATEWAY_DB_THREADS), used
  by every request it serves (authentication, submit, reads, cancel), by its job feed
  (scheduler/notify/feed.py) and by the finishes and heartbeats of the calls it runs itself
  (scheduler/gateway/onehop.py). Each keeps its connection open across calls, so a call costs a
  query, not a connection; a request that waits holds none. Work goes to the thread that went
  idle last (telemachus/threads.py): at low load one thread, its connection and the server
  process behind it serve call after call, warm. Django closes a connection at the end of each
  request (CONN_MAX_AGE); these threads serve no Django request, so their connections stay open
  until they fail. Before each call a connection that saw an error and no longer answers, or that
  the server ended while it sat idle, is closed and reopened (telemachus/db/connections.py); a
  call the connection fails under is run again on a new one when it is `idempotent` or its
  statement certainly did not run.
* A thread of its own (`database_thread`): one thread, one connection kept open with a worker's
  session settings (`worker_database_settings`), for a loop that runs one database call at a
  time: a worker's claims and its writes (scheduler/worker/runner.py), an API process's claims
  (scheduler/gateway/onehop.py). `database_call` runs a call there.
* `database_outage`: the errors that say the connection failed, which a retry on a new
  connection may cure, as opposed to the data being refused."""

import asyncio
import logging
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.db import DatabaseError, InterfaceError, InternalError, OperationalError, close_old_connections, connection

from telemachus.db.connections import connection_refresh, statement_not_run
from telemachus.threads import WarmestFirst

T = TypeVar("T")
log = logging.getLogger(__name__)
_pool: WarmestFirst | None = None


# --- the shared threads --------------------------------------------------------------------------


def _threads() -> WarmestFirst:
    global _pool
    if _pool is None:
        _pool = WarmestFirst(settings.TELEMACHUS_GATEWAY_DB_THREADS, name="telemachus-gateway-db")
    return _pool


async def db(fn: Callable[..., T], /, **kwargs: Any) -> T:
    """Run `fn(**kwargs)` on one of the process's shared database threads."""
    return await asyncio.get_running_loop().run_in_executor(_threads(), partial(_call, fn, kwargs))


def _call(fn: Callable[..., T], kwargs: dict[str, Any]) -> T:
    connection_refresh()
    try:
        return fn(**kwargs)
    except DatabaseError as exc:
        if not database_outage(exc) or not (fn in _idempotent or statement_not_run(exc)):
            raise
        name = getattr(fn, "__qualname__", fn)
        log.warning("database connection lost during %s (%s); retrying on a new one", name, exc)
        connection.close()
        return fn(**kwargs)


_idempotent: set[Callable[..., Any]] = set()


def idempotent(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark a database call that may run twice with the effect of once (a read, a cancel), so `db`
    runs it again on a new connection when the connection fails under it: an in-flight call whose
    connection the server ended gets its answer instead of a 500 while its job runs and is billed.
    A call that writes is sent again only when its statement certainly did not run
    (`statement_not_run`)."""
    _idempotent.add(fn)
    return fn


# --- a thread of its own -------------------------------------------------------------------------


def database_thread(name: str) -> ThreadPoolExecutor:
    """One thread whose connection is its own, kept open, with the worker's session settings (a
    new settings dict for this thread's connection: the process's stays as it is). Close it with
    `database_thread_close`."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=_own_connection)


def _own_connection() -> None:
    connection.settings_dict = worker_database_settings(connection.settings_dict)


async def database_call(thread: ThreadPoolExecutor, fn: Callable[..., T], /, **kwargs: Any) -> T:
    """Run `fn(**kwargs)` on `thread` (a `database_thread`)."""
    return await asyncio.get_running_loop().run_in_executor(thread, partial(_own_call, fn, kwargs))


def _own_call(fn: Callable[..., T], kwargs: dict[str, Any]) -> T:
    # After a database error Django flags the connection; this closes it if it is broken
    # (database restarted, network cut), so the call reconnects instead of failing forever.
    close_old_connections()
    connection_refresh()
    return fn(**kwargs)


async def database_thread_close(thread: ThreadPoolExecutor) -> None:
    """Close the thread's connection, then the thread."""
    await asyncio.get_running_loop().run_in_executor(thread, _close)
    thread.shutdown(wait=True)


def _close() -> None:
    connection.close()  # this thread's


def worker_database_settings(settings_dict: dict[str, Any]) -> dict[str, Any]:
    """A worker's connection settings, from the process's: no pool, kept open, not pinged before
    each use (CONN_HEALTH_CHECKS off: Django would send `SELECT 1` before the first statement after
    every `close_old_connections()`, a round trip before each claim and finish), and on PostgreSQL
    `idle_in_transaction_session_timeout` (TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS). A
    connection used only by its own loop is checked on error instead: a call that finds it broken
    fails as an outage (`database_outage`), which the loop retries or backs off from, and the next
    `close_old_connections()` closes it (Django flags a connection that saw an error), so the retry
    reconnects (tests/concurrency/test_faults.py cuts them fifty times, and restarts the server). A
    worker frozen mid-transaction (stopped, swapped out, stuck in a pause) would otherwise hold its
    locks until it resumes, the claim lock included, and every claim on every host would wait; the
    server ends such a session after the timeout, its transaction rolled back, and the worker's
    next call reconnects. Transactions here never wait on anything but the database.

    Behind a transaction pooler (TELEMACHUS_PGBOUNCER) a session setting cannot reach the server:
    PgBouncer refuses the `options` startup parameter, or drops it when told to ignore it. There
    the pooler's `idle_transaction_timeout` is the bound (it disconnects the client and closes the
    server connection, which rolls back), so none is sent."""
    options = {k: v for k, v in (settings_dict.get("OPTIONS") or {}).items() if k != "pool"}
    timeout = settings.TELEMACHUS_WORKER_IDLE_IN_TRANSACTION_SECONDS
    postgres = settings_dict.get("ENGINE") == "django.db.backends.postgresql"
    if postgres and timeout > 0 and not settings.TELEMACHUS_PGBOUNCER:
        flag = f"-c idle_in_transaction_session_timeout={math.ceil(timeout * 1000)}"
        options["options"] = f"{options.get('options', '')} {flag}".strip()
    return {**settings_dict, "OPTIONS": options, "CONN_MAX_AGE": None, "CONN_HEALTH_CHECKS": False}


# --- outages -------------------------------------------------------------------------------------


def database_outage(exc: DatabaseError) -> bool:
    """Whether the error says the connection failed (retry on a new one), not that the data was
    refused. Behind a transaction pooler (PgBouncer) a server connection terminated while idle in
    the pool answers the next client's BEGIN or COMMIT with its FATAL error and the command's own
    result, which psycopg reports as InternalError "received 2 results from command 'BEGIN'"."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, InternalError) and "results from command" in str(exc)
