"""Recovery needs no single beat: every worker ticks the reconciler on its own timer, and the
tick runs at most once per period across all of them (and any number of beats)."""

from __future__ import annotations

import threading

import pytest
from django.conf import settings

from tasks_app import watchers
from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.runtime import shared_redis
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.test_mirror import (
    assert_converged,
    assert_log_is_gapless,
    remote_total,
    settled,
    wait_for,
)

pytestmark = pytest.mark.django_db(transaction=True)


def _forget_period() -> None:
    shared_redis.client(settings.REDIS_URL).delete(
        f"dashboard:reconcile:{settings.CELERY_TASK_DEFAULT_QUEUE}"
    )


def test_ticks_released_at_once_run_the_reconciler_once() -> None:
    """Eight callers (two beats' ticks and six workers' timers, say) released together: one
    dispatches the unheld task, the others do nothing (no worker listens on this queue)."""
    agent = Agent.objects.create(name="tick", base_url="http://127.0.0.1:9/tick")
    RemoteTask.objects.create(
        agent=agent, phase="task", remote_id="r-tick", state="TASK_STATE_WORKING", watch="poll"
    )
    _forget_period()
    barrier = threading.Barrier(8)
    results: list[int] = []

    def tick() -> None:
        barrier.wait()
        results.append(watchers.reconcile_once())

    threads = [threading.Thread(target=tick) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(results) == [0] * 7 + [1]
    assert watchers.reconcile_once() == 0  # the period is taken
    _forget_period()  # as when it expires
    assert watchers.reconcile_once() == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_any_beat_a_killed_workers_stream_is_held_again(agent, start_celery_worker) -> None:
    first = start_celery_worker(WATCH_LEASE_SECONDS="2", RECONCILE_EVERY_SECONDS="1")
    demo = add_agent(agent.base_url, name="demo")
    before = remote_total(demo)
    task = task_services.start_task(demo, "slow 40 0.15", mode="stream")
    wait_for(
        lambda: TaskEvent.objects.filter(task=task, kind="artifactUpdate").count() >= 3,
        what="chunks",
    )
    first.kill()
    # No beat: the surviving worker's own timer finds the expired lease.
    start_celery_worker(WATCH_LEASE_SECONDS="2", RECONCILE_EVERY_SECONDS="1")
    wait_for(lambda: settled(task), timeout=60, what="the other worker to finish the watch")
    assert task.state == "TASK_STATE_COMPLETED"
    assert_converged(task)
    assert remote_total(demo) == before + 1
    assert RemoteTask.objects.filter(agent=demo).count() == 1
    assert_log_is_gapless(task)


def test_with_redis_down_a_failing_tick_is_said_once_then_counted(
    settings, caplog, monkeypatch
) -> None:
    """With Redis down every tick of every worker logged a traceback of about 120 lines:
    the claim of the period, the push queue's check, and the dispatch through the broker
    (1,245 lines a worker in 30 s). Each is said once with its traceback, then counted, and
    one line says when it works again."""
    for spell in (watchers._claim_failures, watchers._push_check_failures, watchers._tick_failures):
        monkeypatch.setattr(spell, "count", 0)  # no spell of an earlier test's going on
        monkeypatch.setattr(spell, "since", None)
    real_url = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    settings.RECONCILE_EVERY_SECONDS = 0.01
    caplog.set_level("INFO", logger="tasks_app.watchers")
    for _ in range(5):
        assert watchers.reconcile_once() == 0  # nothing to dispatch; ticked anyway
    settings.REDIS_URL = real_url
    _forget_period()
    watchers.reconcile_once()

    ticks = iter([RuntimeError("the broker is down")] * 4 + [None] * 100)

    def tick() -> int:
        failure = next(ticks)
        if failure is not None:
            raise failure
        return 0

    monkeypatch.setattr(watchers, "reconcile_once", tick)
    timer = watchers._ReconcileTimer()
    monkeypatch.setattr(settings, "RECONCILE_IN_WORKERS", True)
    timer.start()
    wait_for(lambda: "reconcile ticks again" in caplog.text, what="a tick that works", timeout=10)
    timer.stop.set()
    assert timer.thread is not None
    timer.thread.join(5)

    with_traceback = [r for r in caplog.records if r.exc_info]
    assert [r.getMessage() for r in with_traceback] == [
        "reconcile: could not claim the period; ticking anyway, and further failures are counted",
        "could not check the push queue; further failures are counted",
        "reconcile tick failed; further failures are counted until a tick works",
    ]
    said = caplog.text
    assert "the period is claimed again: 5 claims failed over" in said
    assert "the push queue is checked again: 5 checks failed over" in said
    assert "reconcile ticks again: 4 ticks failed over" in said
