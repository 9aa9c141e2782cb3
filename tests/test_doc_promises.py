"""Promises the docs make that an audit of README.md and docs/*.md found unkept, kept now.

Each test names the sentence it holds the code to. Nothing here starts a process.
"""

from __future__ import annotations

import json
import uuid

import pytest
from django.test import override_settings
from django.utils import timezone

from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.services import push
from tasks_app.watchers import PARKED_RECHECK_SECONDS

Status = RemoteTask.WatcherStatus


def _push_task(**fields: object) -> RemoteTask:
    name = f"budget-{uuid.uuid4().hex[:8]}"
    agent = Agent.objects.create(name=name, base_url=f"http://127.0.0.1:9/{name}")
    values = {"title": "t", "remote_id": "t-1", "phase": RemoteTask.Phase.TASK,
              "state": "TASK_STATE_WORKING", "watch": RemoteTask.Watch.PUSH,
              "watcher_status": Status.AWAITING_PUSH, **fields}  # fmt: skip
    return RemoteTask.objects.create(agent=agent, **values)


def _chunk(text: str) -> dict:
    return {"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": "a", "parts": [{"text": text}]}}}  # fmt: skip


@pytest.mark.django_db
@pytest.mark.usefixtures("empty_push_queue")
def test_a_push_followed_task_over_its_byte_budget_is_parked() -> None:
    """README, BUDGET_TASK_BYTES: "past it one `budget-exceeded` entry and the task is parked".

    A holder parks a task over its budget; a task followed by push has no holder, so its
    notifications past the budget were dropped and it stayed "awaiting push" for as long as
    the agent kept sending, each delivery moving its hold-off on: never parked, never alerted.
    """
    task = _push_task()
    config = push.new_config(task)
    items = [json.dumps({"t": task.pk, "c": config.pk, "e": _chunk("x" * 5000)}).encode()]
    before = timezone.now()
    with override_settings(BUDGET_TASK_BYTES=1000):
        push.record_batch(items)
        push.record_batch(items)  # more of the same: still parked, still one entry
    task.refresh_from_db()
    assert task.watcher_status == Status.PARKED
    assert "storage budget" in task.watcher_note
    # Parked as a holder parks: looked at again after the parked recheck, not at once.
    assert task.lease_expires_at is not None
    assert (task.lease_expires_at - before).total_seconds() >= PARKED_RECHECK_SECONDS - 1
    notices = TaskEvent.objects.filter(task=task, kind="system")
    assert [e.raw["system"]["event"] for e in notices] == ["budget-exceeded"]
    assert not task.artifacts.exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("empty_push_queue")
def test_a_push_followed_task_within_its_budget_keeps_awaiting_push() -> None:
    """The other side: notifications within the budget leave the task "awaiting push"."""
    task = _push_task()
    config = push.new_config(task)
    items = [json.dumps({"t": task.pk, "c": config.pk, "e": _chunk("small")}).encode()]
    with override_settings(BUDGET_TASK_BYTES=1000):
        push.record_batch(items)
    task.refresh_from_db()
    assert task.watcher_status == Status.AWAITING_PUSH
    assert task.artifacts.count() == 1


@pytest.mark.django_db
@pytest.mark.usefixtures("empty_push_queue")
def test_a_held_or_abandoned_task_over_budget_is_not_parked_by_the_drain() -> None:
    """A holder parks the task it holds itself; an abandoned task stays abandoned."""
    held = _push_task(lease_token="holder", lease_owner="w", watcher_status=Status.POLLING)
    abandoned = _push_task(abandoned_at=timezone.now(), watcher_status=Status.ABANDONED)
    configs = {t.pk: push.new_config(t) for t in (held, abandoned)}
    items = [
        json.dumps({"t": t.pk, "c": configs[t.pk].pk, "e": _chunk("x" * 5000)}).encode()
        for t in (held, abandoned)
    ]
    with override_settings(BUDGET_TASK_BYTES=1000):
        push.record_batch(items)
    held.refresh_from_db()
    abandoned.refresh_from_db()
    assert held.watcher_status == Status.POLLING
    assert abandoned.watcher_status == Status.ABANDONED


@pytest.mark.django_db
def test_a_task_over_its_budget_still_ends() -> None:
    """README, BUDGET_TASK_BYTES: "the state the task ends in is still kept". Past the
    budget every entry was dropped, its state too: a task canceled by an operator, or ended
    at the agent, went on saying "working" for ever and never settled."""
    from tasks_app.services.record import record, settle

    task = _push_task(watch=RemoteTask.Watch.POLL, watcher_status=Status.PARKED)
    big = {"messageId": "m-big", "role": "ROLE_AGENT", "parts": [{"text": "y" * 3000}]}
    with override_settings(BUDGET_TASK_BYTES=1000):
        record(task, _chunk("x" * 5000), "poll")  # past the budget: one notice
        working = {"taskId": "t-1", "status": {"state": "TASK_STATE_WORKING"}}
        assert not record(task, {"statusUpdate": working}, "poll").seqs  # dropped, as before
        ended = {"id": "t-1", "contextId": "c-1", "history": [big],
                 "status": {"state": "TASK_STATE_CANCELED", "timestamp": "2026-12-01T00:00:00Z",
                            "message": big}}  # fmt: skip
        result = record(task, {"task": ended}, "poll")
        again = record(task, {"task": ended}, "poll")
        settle(task.pk, None, note="not reconciled")
    task.refresh_from_db()
    assert result.seqs and result.over_budget and not again.seqs
    assert task.state == "TASK_STATE_CANCELED" and task.settled_at is not None
    assert task.status_message is None and not task.messages.exists()  # its content: not kept
    row = TaskEvent.objects.get(task=task, seq=result.seqs[0])
    assert row.kind == "statusUpdate" and row.raw == {"statusUpdate": {
        "taskId": "t-1", "contextId": "c-1",
        "status": {"state": "TASK_STATE_CANCELED", "timestamp": "2026-12-01T00:00:00Z"}}}  # fmt: skip
    assert "only the state it ends in is kept" in row.note
    assert task.watcher_status == Status.IDLE  # ended: nothing is left to watch
