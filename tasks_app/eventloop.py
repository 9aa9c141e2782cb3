"""The shared asyncio loop of a worker process, where all its watchers run.

A thread per stream collapses at about 200 streams per process; one asyncio
loop holds hundreds at low CPU (docs/architecture.md). Celery tasks only start
watchers: ``submit()`` schedules a coroutine here and returns at once.

Database work (``record()`` and friends, all synchronous Django) runs on a
small thread pool via :func:`db`, so the loop never blocks on a query; a
stream's events are recorded ahead of routine calls (:func:`db_urgent`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from django.conf import settings
from django.db import close_old_connections, connections

from tasks_app import relay

log = logging.getLogger(__name__)
T = TypeVar("T")


def db_threads() -> int:
    """Threads for database work. SQLite takes one writer at a time: more threads
    would only wait on its lock (and its busy handler sleeps), so one does it all.
    PostgreSQL: ``WATCH_DB_THREADS`` (eight by default)."""
    return 1 if connections["default"].vendor == "sqlite" else settings.WATCH_DB_THREADS


URGENT, ROUTINE = 0, 1


class DatabaseThreads:
    """Threads for the holders' database calls, urgent calls first.

    An agent's events waiting to be recorded are what people watch; settling an
    ended task, releasing its lease or noting a status can wait a few
    milliseconds. With one thread (SQLite), a hundred streams ending in the same
    second queued their settle work ahead of the last events of the streams still
    running, and those reached browsers 100-300 ms late (P1, measured). Within a
    priority, calls run in the order they came.
    """

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], Any] | None, Any]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()
        self._name = name
        self._most = threads
        self._threads: list[threading.Thread] = []
        # One permit per thread that finished its call and waits: a call that takes one is
        # sure to be run by a waiting thread; a call that finds none starts a thread.
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()

    def submit(self, func: Callable[[], T], priority: int) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((priority, next(self._order), func, future))
        # Threads start as calls need them (a holder's calls come one at a time): each
        # thread has its own database connection and its own malloc arena, and eight
        # arenas held the peaks of a 90 MB artifact's settling apart (worker RSS +60 MB).
        if self._idle.acquire(timeout=0):
            return future
        with self._lock:
            if len(self._threads) < self._most:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        try:
            while self._run_one():
                pass
        finally:
            connections.close_all()  # this thread's own

    def _run_one(self) -> bool:
        """Run the next call; False when told to stop. A function of its own so that the
        call, its arguments and its result are dropped when it returns, not kept in a
        loop's variables until the next call comes."""
        _, _, func, future = self._queue.get()
        if func is None:
            return False
        if future.set_running_or_notify_cancel():  # else its caller stopped waiting
            try:
                result = func()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
        self._idle.release()
        return True

    def shutdown(self) -> None:
        """Cancel what has not started; each thread ends after its current call."""
        while True:
            try:
                _, _, _, future = self._queue.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                future.cancel()
        with self._lock:
            for _ in self._threads:
                self._queue.put((ROUTINE + 1, next(self._order), None, None))
            self._most = 0  # no new thread after this


_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_db_pool: DatabaseThreads | None = None


def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)

    async def setup() -> None:
        relay.use_loop(loop)
        ready.set()

    loop.run_until_complete(setup())
    loop.run_forever()
    # Stopped (see stop()). Relays after this go the synchronous way; what the loop's relay
    # still queues or holds is sent first (bounded: relay.CLOSE_SECONDS). Then what is still
    # pending (a holder that did not end in time) is cancelled and given its turn to unwind,
    # so nothing is destroyed while pending and the loop closes.
    released = relay.release_loop(loop)
    if released is not None:
        loop.run_until_complete(released.close())
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


# CPython collects its young generation after this many new container objects (700 by
# default); see tune_gc().
GC_YOUNG_THRESHOLD = 10_000
_gc_tuned = False


def tune_gc() -> None:
    """Make the cyclic garbage collector cheap for a process that records streams (once).

    A fast stream's batch allocates thousands of short-lived objects (parsed events,
    rows, relay messages). With CPython's defaults that made about 160 young and one
    full collection per 10,000 events, and each full one walked every object the
    process had loaded (Django, the app and its libraries, about 135,000): 12-19 us
    an event in all, a tenth of ``record()``'s time (P3, timed with ``gc.callbacks``).

    1. What exists when the loop starts (the code and settings loaded at start-up,
       which live as long as the process) moves to the permanent generation
       (``gc.freeze``): full collections no longer walk it.
    2. The young generation is collected every ``GC_YOUNG_THRESHOLD`` allocations, so a
       batch's objects are mostly gone before a collection looks at them and are not
       promoted to be walked again later. Together: 2.6-3.2 us an event, no full
       collection in 10,000 events.
    """
    global _gc_tuned
    if _gc_tuned:
        return
    _gc_tuned = True
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def get_loop() -> asyncio.AbstractEventLoop:
    """The process's shared loop, started on first use in a daemon thread."""
    global _loop, _thread, _db_pool
    with _lock:
        if _loop is None or (
            not _loop.is_running() and _thread is not None and not _thread.is_alive()
        ):
            tune_gc()  # this process holds streams from now on (once: a restart changes nothing)
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            _db_pool = DatabaseThreads(db_threads(), "watch-db")
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
    return await _run_on(ROUTINE, func, *args, **kwargs)


async def db_urgent(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Like :func:`db`, ahead of routine calls: recording events that people are watching."""
    return await _run_on(URGENT, func, *args, **kwargs)


# How often a database thread does Django's per-request connection upkeep (at most).
UPKEEP_EVERY = 1.0
_upkeep = threading.local()


def upkeep_connections() -> None:
    """Django's per-request connection upkeep, at most once a second per thread.

    ``close_old_connections()`` drops broken and too-old connections; with health
    checks on, it also makes the next query first run ``SELECT 1``. Before every
    call, that was one more round trip per recorded event on PostgreSQL
    (profiled, P1). Once a second is enough to retire old connections, and a
    connection that raised a database error is checked before the next call.
    """
    now, last = time.monotonic(), getattr(_upkeep, "at", None)
    failed = any(c.errors_occurred for c in connections.all(initialized_only=True))
    if last is None or failed or now - last >= UPKEEP_EVERY:
        close_old_connections()
        _upkeep.at = now


async def _run_on(priority: int, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    assert _db_pool is not None

    # The caller's context (logs.bind's task and agent ids) goes with the call: lines written
    # inside it (record, dispatch) named neither.
    context = contextvars.copy_context()

    def call() -> T:
        upkeep_connections()
        return context.run(func, *args, **kwargs)

    return await asyncio.wrap_future(_db_pool.submit(call, priority))


# Calls that can wait seconds (settling an ended task) run this many at a time, per gate.
LATER_AT_ONCE = 2
_later_gates: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Semaphore] = {}


def later(key: str = "") -> asyncio.Semaphore:
    """The running loop's gate ``key`` for work that can wait: ``async with eventloop.later():``.

    Every thread running Python delays the loop, which needs the interpreter lock
    for each step of every stream and relay: with a hundred tasks ending in the
    same second, their settling (a GetTask each, then a fold of the agent's whole
    task) all at once held the last events of the other streams back by up to a
    second (P1 on PostgreSQL: p99 0.3-1.8 s; 59-127 ms with the gates). Work with a
    bound of its own (the fold) shares the one unnamed gate; a call to an agent,
    which a slow agent could make last, goes through a gate of that agent's own
    (``f"agent-{pk}"``), so it never stalls anyone else's.
    """
    loop = asyncio.get_running_loop()
    gate = _later_gates.get((loop, key))
    if gate is None:
        for old in [known for known in _later_gates if known[0].is_closed()]:
            del _later_gates[old]
        gate = _later_gates[(loop, key)] = asyncio.Semaphore(LATER_AT_ONCE)
    return gate


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
        _db_pool.shutdown()
    _loop = None
