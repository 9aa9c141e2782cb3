"""Tasks that end together settle a few at a time, on holders in this process.

Settling an ended task (a GetTask, then a fold of the agent's whole task) is the
work that can wait; the last events of the streams still running cannot. With
a hundred tasks ending in the same second, eight threads settling at once held
those events back by up to a second (P1 on PostgreSQL). Here tasks on a real
a2a-sdk agent end together, each settle is slowed so that they overlap, and no
more than ``eventloop.LATER_AT_ONCE`` run at once; every task still settles.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tasks_app import eventloop, watchers
from tasks_app.models import RemoteTask
from tasks_app.services import record as record_services
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.test_answers_live import in_process_holders  # noqa: F401 (a fixture)
from tests.test_mirror import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

TASKS = 6


def test_tasks_ending_together_settle_a_few_at_a_time(agent, monkeypatch, in_process_holders):  # noqa: F811
    lock = threading.Lock()
    inside, peak, settled = 0, 0, []
    real_settle = record_services.settle

    def slow_settle(task_pk: int, *args, **kwargs):
        nonlocal inside, peak
        with lock:
            inside += 1
            peak = max(peak, inside)
        try:
            time.sleep(0.4)  # long enough that the tasks' settles would overlap
            return real_settle(task_pk, *args, **kwargs)
        finally:
            with lock:
                inside -= 1
                settled.append(task_pk)

    monkeypatch.setattr(record_services, "settle", slow_settle)
    # Threads enough that, without the gate, every settle would run at once (on SQLite the
    # loop's pool has one thread; the slowed part waits before touching the database).
    monkeypatch.setattr(eventloop, "db_threads", lambda: TASKS)
    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))
    demo = add_agent(agent.base_url, name="demo")
    tasks = [task_services.start_task(demo, "slow 2 0.3", mode="stream") for _ in range(TASKS)]
    # A settle's commit is seen a moment before its wrapper notes it (the ``finally`` above
    # runs after the commit): wait for both.
    wait_for(
        lambda: (
            all(RemoteTask.objects.get(pk=t.pk).settled_at is not None for t in tasks)
            and len(settled) >= TASKS
        ),
        timeout=60,
        what="every task to settle",
    )
    assert sorted(settled) == sorted(t.pk for t in tasks)
    assert peak == eventloop.LATER_AT_ONCE
    for task in tasks:
        task.refresh_from_db()
        assert task.state == "TASK_STATE_COMPLETED"


def test_an_agent_slow_to_answer_the_settling_gettask_holds_back_only_its_own(
    agent,
    agent_nopush,
    monkeypatch,
    in_process_holders,  # noqa: F811
):
    """The GetTasks wait per agent, the folds together: an agent whose GetTask hangs (for as
    many of its tasks as its gate lets through, and more) stops no other agent's settling."""
    from tasks_app.a2a import A2AClient

    real_get_task = A2AClient.get_task
    hanging: list[str] = []

    async def get_task(self, task_id: str, *args, **kwargs):
        if str(agent_nopush.port) in self.interface.url:
            hanging.append(task_id)
            await asyncio.sleep(60)  # an agent that does not answer (the test ends first)
        return await real_get_task(self, task_id, *args, **kwargs)

    monkeypatch.setattr(A2AClient, "get_task", get_task)
    monkeypatch.setattr(eventloop, "db_threads", lambda: TASKS)
    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))
    slow = add_agent(agent_nopush.base_url, name="slow")
    healthy = add_agent(agent.base_url, name="healthy")
    stuck = [task_services.start_task(slow, "slow 2 0.3", mode="stream") for _ in range(3)]
    fine = [task_services.start_task(healthy, "slow 2 0.3", mode="stream") for _ in range(TASKS)]

    def settled(tasks: list) -> int:
        return sum(RemoteTask.objects.get(pk=t.pk).settled_at is not None for t in tasks)

    wait_for(lambda: settled(fine) == TASKS, timeout=60, what="the healthy agent's tasks to settle")
    assert settled(stuck) == 0
    # Each stuck stream has ended by now or soon (a loaded machine is slower to get there):
    # all three want to settle, as many as the gate lets through ask, the third waits.
    wait_for(
        lambda: (
            RemoteTask.objects.filter(
                pk__in=[t.pk for t in stuck], state="TASK_STATE_COMPLETED"
            ).count()
            == 3
        ),
        timeout=30,
        what="the slow agent's streams to end",
    )
    wait_for(lambda: len(hanging) == eventloop.LATER_AT_ONCE, timeout=30, what="two GetTasks")
    time.sleep(1)
    assert len(hanging) == eventloop.LATER_AT_ONCE  # the third waits behind its own agent
    assert settled(stuck) == 0
