"""The holders' database threads: urgent calls first, order kept within a priority.

P1 (100 streams, one SQLite thread) measured why: a hundred streams ending in the same second
queued their settle work ahead of the last events of the streams still running, and those
reached browsers 100-300 ms late. Recording a stream's events is urgent; the rest is routine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
from django.db import DatabaseError, connection

from tasks_app import eventloop
from tasks_app.eventloop import ROUTINE, URGENT, DatabaseThreads


def _busy_pool() -> tuple[DatabaseThreads, threading.Event, concurrent.futures.Future]:
    """One thread, held by a call that waits until released: what comes next queues."""
    pool = DatabaseThreads(1, "test-db")
    release = threading.Event()
    started = threading.Event()

    def hold() -> str:
        started.set()
        release.wait(10)
        return "held"

    holding = pool.submit(hold, ROUTINE)
    assert started.wait(10)
    return pool, release, holding


def test_urgent_calls_run_before_routine_ones_queued_earlier() -> None:
    pool, release, holding = _busy_pool()
    ran: list[str] = []
    futures = [
        pool.submit(lambda: ran.append("settle"), ROUTINE),
        pool.submit(lambda: ran.append("release lease"), ROUTINE),
        pool.submit(lambda: ran.append("events 1"), URGENT),
        pool.submit(lambda: ran.append("events 2"), URGENT),
    ]
    release.set()
    concurrent.futures.wait([holding, *futures], timeout=10)
    assert holding.result() == "held"
    assert ran == ["events 1", "events 2", "settle", "release lease"]
    pool.shutdown()


def test_results_and_errors_reach_the_caller() -> None:
    pool = DatabaseThreads(2, "test-db")

    def fails() -> None:
        raise ValueError("no such task")

    assert pool.submit(lambda: 41 + 1, URGENT).result(10) == 42
    failed = pool.submit(fails, ROUTINE)
    assert isinstance(failed.exception(10), ValueError)
    pool.shutdown()


def test_a_call_its_caller_stopped_waiting_for_never_runs() -> None:
    pool, release, holding = _busy_pool()
    ran: list[str] = []
    abandoned = pool.submit(lambda: ran.append("abandoned"), URGENT)
    kept = pool.submit(lambda: ran.append("kept"), ROUTINE)
    assert abandoned.cancel()
    release.set()
    kept.result(10)
    holding.result(10)
    assert ran == ["kept"]
    pool.shutdown()


def test_shutdown_cancels_what_has_not_started_and_ends_the_threads() -> None:
    pool, release, holding = _busy_pool()
    waiting = pool.submit(lambda: "never", ROUTINE)
    pool.shutdown()
    assert waiting.cancelled()
    release.set()
    assert holding.result(10) == "held"  # the running call finishes
    for thread in pool._threads:
        thread.join(10)
        assert not thread.is_alive()


def test_awaited_from_a_loop_cancellation_reaches_the_queued_call() -> None:
    """``eventloop.db`` awaits these futures; a holder cancelled while its call waits in the
    queue must not have the call run later (it wraps the future, so the cancel goes through)."""
    pool, release, holding = _busy_pool()
    ran: list[str] = []

    async def main() -> None:
        waiting = asyncio.ensure_future(
            asyncio.wrap_future(pool.submit(lambda: ran.append("late"), ROUTINE))
        )
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(main())
    after = pool.submit(lambda: ran.append("after"), ROUTINE)
    release.set()
    after.result(10)
    holding.result(10)
    assert ran == ["after"]
    pool.shutdown()


def test_threads_start_only_as_calls_need_them() -> None:
    """Calls that come one at a time (one holder) use one thread, not the pool's eight: each
    thread holds its own connection and malloc arena (a 90 MB artifact's settling cost the
    worker 60 MB more when its calls were spread over eight)."""
    pool = DatabaseThreads(8, "test-db")
    for i in range(20):
        assert pool.submit(lambda i=i: i, ROUTINE).result(10) == i
    assert len(pool._threads) == 1
    release = threading.Event()
    held = [pool.submit(lambda: release.wait(10), ROUTINE) for _ in range(3)]
    deadline = time.monotonic() + 10
    while len(pool._threads) < 3 and time.monotonic() < deadline:
        pool.submit(lambda: None, ROUTINE).result(10)
    assert 3 <= len(pool._threads) <= 8  # calls waiting together get threads, up to the limit
    release.set()
    for future in held:
        assert future.result(10) is True
    pool.shutdown()


@pytest.mark.django_db(transaction=True)
def test_connection_upkeep_runs_once_a_second_or_after_a_database_error(monkeypatch) -> None:
    """Django's per-request upkeep made every call on PostgreSQL run ``SELECT 1`` first (its
    health check): a database thread does it at most once a second, or at once after an error."""
    runs: list[float] = []
    real = eventloop.close_old_connections

    def counted() -> None:
        runs.append(time.monotonic())
        real()

    monkeypatch.setattr(eventloop, "close_old_connections", counted)

    def in_a_fresh_thread() -> list[int]:
        seen = []
        for _ in range(200):  # calls in quick succession: one upkeep
            eventloop.upkeep_connections()
            connection.ensure_connection()
        seen.append(len(runs))
        with pytest.raises(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table")
        assert connection.errors_occurred
        eventloop.upkeep_connections()  # after an error: at once, and the flag is cleared
        seen.append(len(runs))
        assert not connection.errors_occurred
        time.sleep(eventloop.UPKEEP_EVERY + 0.1)
        eventloop.upkeep_connections()
        seen.append(len(runs))
        connection.close()
        return seen

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(in_a_fresh_thread).result(30) == [1, 2, 3]


def test_work_that_can_wait_runs_a_few_at_a_time_and_each_loop_has_its_own_gate() -> None:
    """``eventloop.later()``: twelve callers released at once, at most LATER_AT_ONCE inside."""
    inside, peak = 0, 0

    async def settle_one() -> None:
        nonlocal inside, peak
        async with eventloop.later():
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.02)
            inside -= 1

    async def main() -> asyncio.Semaphore:
        await asyncio.gather(*(settle_one() for _ in range(12)))
        return eventloop.later()

    first = asyncio.run(main())
    assert peak == eventloop.LATER_AT_ONCE == 2
    second = asyncio.run(main())  # a new loop (a restarted worker loop, a test): a new gate
    assert second is not first
    assert first not in eventloop._later_gates.values()  # the closed loop's gate is dropped


@pytest.mark.subprocess
def test_the_first_loop_of_a_process_makes_the_collector_cheap_once() -> None:
    """A fast stream's batches allocate thousands of short-lived objects; with CPython's
    defaults the full collections walked everything the process had loaded. In a fresh
    process: the loop's first start freezes what is loaded and raises the young
    generation's threshold; later calls freeze nothing more."""
    import json
    import subprocess
    import sys

    script = (
        "import gc, json, weakref, django; django.setup()\n"
        "from tasks_app import eventloop\n"
        "before = (gc.get_freeze_count(), gc.get_threshold())\n"
        "eventloop.get_loop()\n"
        "first = (gc.get_freeze_count(), gc.get_threshold())\n"
        "class Cycle: pass\n"
        "cycle = Cycle(); cycle.itself = cycle; ref = weakref.ref(cycle); del cycle\n"
        "eventloop.tune_gc()\n"
        "gc.collect()\n"
        "print(json.dumps([before, first, ref() is None]))\n"
        "eventloop.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    before, first, collected = json.loads(done.stdout.splitlines()[-1])
    assert before[0] == 0 and before[1][0] == 700, before  # CPython's defaults
    assert first[0] > 10_000, first  # Django, the app and the libraries loaded so far
    assert first[1] == [eventloop.GC_YOUNG_THRESHOLD, before[1][1], before[1][2]]
    # Garbage made after the first start is still collected: the second call froze nothing.
    assert collected
