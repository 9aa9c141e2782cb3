"""The shared asyncio loop of a worker process, where all its watchers run.

A thread per stream collapses at about 200 streams per process; one asyncio
loop holds hundreds at low CPU (docs/architecture.md). Celery tasks only start
watchers: ``submit()`` schedules a coroutine here and returns at once.

Database work (``record()`` and friends, all synchronous Django) runs on a
small thread pool via :func:`db`, so the loop never blocks on a query.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from django.db import close_old_connections, connections

from tasks_app import relay

log = logging.getLogger(__name__)
T = TypeVar("T")


def db_threads() -> int:
    """Threads for database work. SQLite takes one writer at a time: more threads
    would only wait on its lock (and its busy handler sleeps), so one does it all."""
    return 1 if connections["default"].vendor == "sqlite" else 8


_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_db_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _close_thread_connections() -> None:
    connections.close_all()


def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)

    async def setup() -> None:
        relay.use_loop(loop)
        ready.set()

    loop.run_until_complete(setup())
    loop.run_forever()
    # Stopped (see stop()). What is still pending (the relay's sender, a holder that did
    # not end in time) is cancelled and given its turn to unwind, so nothing is destroyed
    # while pending and the loop closes; relays after this go the synchronous way.
    relay.release_loop(loop)
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


def get_loop() -> asyncio.AbstractEventLoop:
    """The process's shared loop, started on first use in a daemon thread."""
    global _loop, _thread, _db_pool
    with _lock:
        if _loop is None or (
            not _loop.is_running() and _thread is not None and not _thread.is_alive()
        ):
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            _db_pool = concurrent.futures.ThreadPoolExecutor(
                db_threads(), thread_name_prefix="watch-db"
            )
            _thread = threading.Thread(
                target=_run, args=(loop, ready), name="watch-loop", daemon=True
            )
            _thread.start()
            ready.wait(10)
            _loop = loop
        return _loop


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    return asyncio.run_coroutine_threadsafe(coro, get_loop())


async def db(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run synchronous database code on the pool, from the loop."""
    assert _db_pool is not None
    return await _run_on(_db_pool, func, *args, **kwargs)


async def _run_on(
    pool: concurrent.futures.Executor, func: Callable[..., T], *args: Any, **kwargs: Any
) -> T:
    def call() -> T:
        close_old_connections()
        return func(*args, **kwargs)

    return await asyncio.get_running_loop().run_in_executor(pool, call)


def running() -> bool:
    return _loop is not None and _loop.is_running()


def stop(timeout: float = 10.0) -> None:
    """Stop the loop after ``shutdown`` coroutines registered with it ran (see watchers)."""
    global _loop
    loop = _loop
    if loop is None:
        return
    loop.call_soon_threadsafe(loop.stop)
    if _thread is not None:
        _thread.join(timeout)
    if _db_pool is not None:
        _db_pool.submit(_close_thread_connections)
        _db_pool.shutdown(wait=False, cancel_futures=True)
    _loop = None
