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
