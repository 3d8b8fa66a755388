"""The database threads of the gateway: a few threads, shared by every request of the process,
that run its database calls (authentication, submit, reads, cancel). Each keeps its connection
open across calls, so a call costs a query, not a connection; a request that waits holds none.
Work goes to the thread that went idle last (telemachus/threads.py): at low load one thread, its
connection and the server process behind it serve call after call, warm.

Django closes a connection at the end of each request (CONN_MAX_AGE); these threads serve no
Django request, so their connections stay open until they fail: a connection that saw an error
and no longer answers is closed and reopened on the next call."""

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from django.conf import settings
from django.db import connection

from telemachus.threads import WarmestFirst

T = TypeVar("T")
_pool: WarmestFirst | None = None


def _threads() -> WarmestFirst:
    global _pool
    if _pool is None:
        _pool = WarmestFirst(settings.TELEMACHUS_GATEWAY_DB_THREADS, name="telemachus-gateway-db")
    return _pool


async def db(fn: Callable[..., T], /, **kwargs: Any) -> T:
    """Run `fn(**kwargs)` on one of the gateway's database threads."""
    return await asyncio.get_running_loop().run_in_executor(_threads(), partial(_call, fn, kwargs))


def _call(fn: Callable[..., T], kwargs: dict[str, Any]) -> T:
    if connection.connection is not None and connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()
    return fn(**kwargs)
