"""A worker SIGKILLed in the middle of the push drain's batch: the next worker records it all.

Real Celery workers on this session's queue and Redis, the webhook's own code path for every
notification, a real SIGKILL while the first tasks of the batch are committed and the rest
are not. The drain popped its batch before recording it, so what the killed worker had not
committed was lost, with nothing in any task's log to say so.
"""

from __future__ import annotations

import time
import uuid
from contextlib import ExitStack

import pytest
from django.db import connection, transaction
from django.db.models import F

from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push
from tests.test_push_webhook import good, status_update

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("empty_push_queue"),
    pytest.mark.slow,
]

TASKS = 40
EACH = 40  # notifications per task: 1,600 in all, one drain batch


def wait_until(check, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(step)
    return False


def hold_write_lock(held: ExitStack, task: RemoteTask) -> None:
    """Open a transaction that writes ``task``'s row and keep it open until ``held`` closes.

    On PostgreSQL that locks the row: the drain's record of that task waits on it (SQLite
    has no row locks: :func:`stall_sqlite_writes`)."""
    held.enter_context(transaction.atomic())
    RemoteTask.objects.filter(pk=task.pk).update(title=F("title"))


def stall_sqlite_writes(held: ExitStack, task: RemoteTask) -> None:
    """Hold whoever first writes a log row of ``task`` inside that write, until killed.

    SQLite has one writer at a time and no row locks. Seized between two of the drain's
    transactions, the write lock came too late at times: the drain had committed its whole
    batch (CI: 1,600 of 1,600). A trigger that counts a three-way cross join of the log
    (about 3.8e9 rows, minutes) holds the drain's writer inside that task's transaction
    instead, every other task committed. Dropped when ``held`` closes (after the kill: the
    drop waits for the write lock).
    """
    table = TaskEvent._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TRIGGER stall_drain BEFORE INSERT ON {table} "
            f"WHEN NEW.task_id = {int(task.pk)} BEGIN "
            f"SELECT count(*) FROM {table} a, {table} b, {table} c; END"
        )

    def drop() -> None:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS stall_drain")

    held.callback(drop)


def test_a_worker_killed_mid_batch_leaves_it_to_the_next_worker(start_celery_worker) -> None:
    agent = Agent.objects.create(
        name="pushy", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    tasks = [
        RemoteTask.objects.create(
            agent=agent,
            title=f"t{n}",
            remote_id=f"t-{n}",
            phase=RemoteTask.Phase.TASK,
            state="TASK_STATE_SUBMITTED",
            watch=RemoteTask.Watch.PUSH,
        )
        for n in range(TASKS)
    ]
    sent = {
        task.pk: [f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z" for i in range(EACH)]
        for task in tasks
    }
    first = start_celery_worker()
    r = push._redis()
    # Queued through the webhook while a drain counts as scheduled already (its flag set), so
    # the whole queue waits; then one drain is scheduled and the worker starts on it at once.
    r.set(push.DRAIN_KEY, 1, ex=300)
    for task in tasks:
        config = push.new_config(task)
        for ts in sent[task.pk]:
            assert good(config, status_update(task.remote_id, ts=ts))[0] == 202
    total = TASKS * EACH
    assert r.llen(push.QUEUE_KEY) == total
    pushed = TaskEvent.objects.filter(channel="push")
    # The worker is held inside the batch's last task when it is killed. Killed as soon as
    # its first commit showed, it had at times committed the whole batch already.
    with ExitStack() as held:
        if connection.vendor == "postgresql":
            # The batch's last task is locked before the drain starts: every other task
            # commits and that one waits (it is the last of its group).
            hold_write_lock(held, tasks[-1])
            r.delete(push.DRAIN_KEY)
            assert push.schedule_if_waiting()
        else:
            # The last task's first log row holds the drain inside its transaction.
            stall_sqlite_writes(held, tasks[-1])
            held.callback(first.kill)  # before the trigger is dropped, whatever fails
            r.delete(push.DRAIN_KEY)
            assert push.schedule_if_waiting()
        waited = wait_until(lambda: pushed.count() == total - EACH, timeout=120)
        assert waited, (pushed.count(), first.log_tail())
        committed = pushed.count()
        first.kill()
    assert 0 < committed < total, committed  # killed inside the batch, not after it
    assert r.llen(push.QUEUE_KEY) == total  # the batch is still queued, in order

    # The killed drain's claim and its scheduling flag lapse (RUNNING_SECONDS, 15 s; here at
    # once), and the reconciler's tick schedules the next drain.
    r.delete(push.RUNNING_KEY, push.DRAIN_KEY)
    assert push.schedule_if_waiting()
    second = start_celery_worker()
    drained = wait_until(lambda: r.llen(push.QUEUE_KEY) == 0, timeout=120, step=0.1)
    assert drained, second.log_tail()
    for task in tasks:
        rows = TaskEvent.objects.filter(task=task, channel="push").order_by("seq")
        stamps = [row.raw["statusUpdate"]["status"]["timestamp"] for row in rows]
        assert stamps == sent[task.pk], (task.pk, len(stamps))  # every one, once, in order
    # Each counted once as well: on PostgreSQL the killed drain had counted the groups it
    # committed, and the next one counted them again.
    received = PushConfig.objects.filter(task__in=tasks).values_list("received", flat=True)
    assert sorted(received) == [EACH] * TASKS
    assert int(r.get(push.QUEUE_BYTES_KEY) or 0) == 0
