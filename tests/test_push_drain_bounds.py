"""The push drain's promises (docs/architecture.md): a batch is bounded in bytes, and a task
whose notifications could not be recorded says so in its log.

Real Redis (the session's database) and the real ``record_many``; only the contention that
makes ``record_many`` give up is forced, since real contention cannot be made reliably.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push
from tasks_app.services.record import MAX_RETRIES, RecordError

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("empty_push_queue")]

BOUND = 10_000  # DRAIN_BATCH_BYTES here: 32 MB of items is slow to build on a shared machine


def item(n: int, size: int) -> bytes:
    """A queued item ``size`` bytes long that says where it was in the queue."""
    return f"{n:06d}".encode().ljust(size, b"x")


def enqueue(items: list[bytes]) -> None:
    """What the webhook's queue script does for each: RPUSH, and count its bytes."""
    r = push._redis()
    r.rpush(push.QUEUE_KEY, *items)
    r.incrby(push.QUEUE_BYTES_KEY, sum(len(x) for x in items))


@pytest.mark.parametrize("largest_body", [1024 * 1024, 100], ids=["by-script", "by-chunks"])
def test_a_take_is_bounded_by_bytes_even_when_large_items_precede_small_ones(
    settings: Any, monkeypatch: pytest.MonkeyPatch, largest_body: int
) -> None:
    """The drain sized a batch by the queue's mean item: three 4 KB items ahead of 2,000 tiny ones
    made a batch of 17.7 KB against a 10 KB bound (at the real bound, ~200 MB in one worker).

    ``largest_body`` picks the path: with room below a delivery's largest the rest is read
    by the script; with a small largest, by chunks whose surplus is left for the next batch.
    Each batch is taken off once "recorded", as the drain does, while it holds the claim.
    """
    settings.PUSH_MAX_BODY_BYTES = largest_body
    monkeypatch.setattr(push, "DRAIN_BATCH_BYTES", BOUND)
    monkeypatch.setattr(push, "DRAIN_BATCH", 400)
    r = push._redis()
    first = [item(n, 4_000) for n in range(3)] + [item(n, 20) for n in range(3, 2_003)]
    first += [item(2_003, 3 * BOUND)]  # larger than the bound: a batch of its own
    first += [item(n, 20) for n in range(2_004, 2_504)]
    enqueue(first)
    later = [item(n, 30) for n in range(2_504, 2_604)]  # pushed while the drain runs

    r.set(push.RUNNING_KEY, "this-drain")
    batches: list[list[bytes]] = []
    while batch := push._read_batch(r):
        assert push._read_batch(r) == batch  # read, not taken: a drain that dies leaves it queued
        assert push._take_off(r, "this-drain", batch)
        batches.append(batch)
        size = sum(len(x) for x in batch)
        assert len(batch) <= push.DRAIN_BATCH
        assert size <= BOUND or len(batch) == 1, (len(batches), len(batch), size)
        left = r.lrange(push.QUEUE_KEY, 0, -1)
        assert int(r.get(push.QUEUE_BYTES_KEY)) == sum(len(x) for x in left)
        if len(batches) == 1:
            enqueue(later)
    taken = [x for batch in batches for x in batch]
    assert taken == first + later  # nothing lost, nothing repeated, in queue order
    assert [len(b) for b in batches if sum(len(x) for x in b) > BOUND] == [1]
    assert r.llen(push.QUEUE_KEY) == 0 and int(r.get(push.QUEUE_BYTES_KEY)) == 0


def test_a_drain_that_lost_its_claim_takes_nothing_off_the_queue() -> None:
    """A batch leaves the queue only once recorded, by the drain holding the claim. A drain
    that stalled past its claim and then finished its batch would otherwise take off the
    head again: notifications that arrived since, which the drain that took over had not
    yet read."""
    r = push._redis()
    enqueue([item(n, 50) for n in range(3)])
    r.set(push.RUNNING_KEY, "stalled")
    stalled_batch = push._read_batch(r)
    r.set(push.RUNNING_KEY, "took-over")  # the claim lapsed while the first drain stalled
    batch = push._read_batch(r)
    assert batch == stalled_batch  # the same head, recorded again by the new drain
    assert push._take_off(r, "took-over", batch)
    later = [item(n, 50) for n in range(3, 5)]
    enqueue(later)
    assert not push._take_off(r, "stalled", stalled_batch)  # the stalled drain wakes: nothing
    assert r.lrange(push.QUEUE_KEY, 0, -1) == later
    assert int(r.get(push.QUEUE_BYTES_KEY)) == sum(len(x) for x in later)


def status_update(task: RemoteTask) -> bytes:
    status = {"state": "TASK_STATE_WORKING", "timestamp": "2026-01-01T00:00:01Z"}
    return json.dumps(
        {"statusUpdate": {"taskId": task.remote_id, "contextId": "c", "status": status}}
    ).encode()


def queued_for(config: PushConfig, task: RemoteTask) -> bytes:
    """A queued notification as the webhook writes it (see push._queued)."""
    return b'{"c": %d, "t": %d, "e": %b}' % (config.pk, task.pk, status_update(task))


def push_task(agent: Agent, name: str) -> RemoteTask:
    return RemoteTask.objects.create(
        agent=agent, title=name, remote_id=f"r-{name}", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_SUBMITTED", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip


def test_a_task_whose_batch_loses_to_contention_gets_a_protocol_error_row(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A RecordError from record_many was only logged: when it gave up after MAX_RETRIES
    concurrent updates, the task still existed, its notifications were off the queue, and
    its log showed nothing of them. A task deleted meanwhile still gets no row (none can be
    written) and no attempt at one; the batch's other tasks are recorded."""
    agent = Agent.objects.create(
        name="pushy", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    busy, fine, gone = (push_task(agent, name) for name in ("busy", "fine", "gone"))
    items = [queued_for(push.new_config(task), task) for task in (busy, fine, gone)]
    real_record_many = push.record_many
    calls: list[tuple[int, str]] = []

    def contended(task: RemoteTask | int, objs: list[Any], channel: str, **kwargs: Any) -> Any:
        pk = task if isinstance(task, int) else task.pk
        calls.append((pk, channel))
        if (pk, channel) == (busy.pk, "push"):  # as record_many says when it gives up
            raise RecordError(f"task {pk}: gave up after {MAX_RETRIES} concurrent updates")
        if (pk, channel) == (gone.pk, "push"):  # deleted by an operator meanwhile
            RemoteTask.objects.filter(pk=pk).delete()
        return real_record_many(task, objs, channel, **kwargs)

    monkeypatch.setattr(push, "record_many", contended)
    with caplog.at_level(logging.WARNING, logger=push.log.name):
        touched = push.record_batch(items)

    assert set(touched) == {fine.pk}
    assert list(fine.events.values_list("channel", "kind")) == [("push", "statusUpdate")]
    row = TaskEvent.objects.get(task=busy)
    assert (row.channel, row.kind) == ("system", "protocol-error")
    assert "1 push notification(s) could not be recorded (RecordError)" in json.dumps(row.raw)
    assert not RemoteTask.objects.filter(pk=gone.pk).exists()
    assert [call for call in calls if call[0] == gone.pk] == [(gone.pk, "push")]  # no note tried
    warned = [rec.getMessage() for rec in caplog.records]
    assert any(f"task {busy.pk} not recorded: " in line for line in warned), warned
    assert any(f"task {gone.pk} not recorded: " in line for line in warned), warned
    assert not any("could not note" in line for line in warned), warned


def test_a_delivery_queued_while_the_drain_finds_the_queue_empty_keeps_its_bytes_counted() -> None:
    """The drain looked at the queue's length and then reset its byte count: a delivery queued
    between the two lost its bytes from the count, which then stood below what the queue held
    (and went negative as the drain took the delivery off)."""
    r = push._redis()
    queued = item(1, 500)

    class DeliveryInTheWindow:
        """The drain's Redis, with a delivery queued right after its first look at the length."""

        looked = False

        def __getattr__(self, name: str) -> Any:
            return getattr(r, name)

        def llen(self, key: str) -> int:
            length = r.llen(key)
            if not self.looked:
                self.looked = True
                enqueue([queued])
            return length

    drains_redis = DeliveryInTheWindow()
    push._cleared_and_empty(drains_redis)  # type: ignore[arg-type]
    assert drains_redis.looked  # the delivery came inside the drain's look
    assert r.lrange(push.QUEUE_KEY, 0, -1) == [queued]
    assert int(r.get(push.QUEUE_BYTES_KEY)) == len(queued)


def test_a_drain_keeps_its_claim_through_a_long_batch_and_a_killed_one_lets_it_go_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim (and the scheduling flag) lived 60 s, renewed only between batches: after a
    worker was killed mid-drain, 897 notifications waited a minute while streams were taken
    over in six seconds (a soak run). A heartbeat now keeps both alive while the drain runs,
    and both lapse within RUNNING_SECONDS of its death."""
    import asyncio

    monkeypatch.setattr(push, "RUNNING_SECONDS", 1)
    monkeypatch.setattr(push, "HEARTBEAT_SECONDS", 0.2)
    r = push._redis()
    r.set(push.RUNNING_KEY, "this-drain", ex=1)
    r.set(push.DRAIN_KEY, 1, ex=60)  # as scheduled

    async def a_long_batch() -> None:
        keeper = asyncio.ensure_future(push._keep_claim(r, "this-drain"))
        await asyncio.sleep(2.5)  # longer than the claim's own life
        assert r.get(push.RUNNING_KEY) == b"this-drain"
        assert 0 < r.pttl(push.DRAIN_KEY) <= 1000  # no longer the scheduler's 60 s
        keeper.cancel()  # the worker dies: nothing renews any more

    asyncio.run(a_long_batch())
    time.sleep(1.3)
    assert r.get(push.RUNNING_KEY) is None and r.get(push.DRAIN_KEY) is None


def test_a_push_task_that_asks_is_waiting_for_an_answer_not_awaiting_push() -> None:
    """A push task whose notification asked a question said "awaiting push" for as long as
    nobody answered, where a streamed one says "waiting for an answer"; its next look at the
    question is WATCH_QUESTION_RECHECK_SECONDS away (the drain has just read the task), as a
    streamed one's; a notification after the answer follows by push again."""
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:9/")
    task = push_task(agent, "asks")
    RemoteTask.objects.filter(pk=task.pk).update(
        watcher_status=RemoteTask.WatcherStatus.AWAITING_PUSH, state="TASK_STATE_WORKING"
    )
    config = PushConfig.objects.create(task=task, config_id="cfg-asks")
    asking = {"state": "TASK_STATE_INPUT_REQUIRED", "timestamp": "2026-01-01T00:00:02Z"}
    event = {"statusUpdate": {"taskId": task.remote_id, "contextId": "c", "status": asking}}
    push.record_batch([json.dumps({"c": config.pk, "t": task.pk, "e": event}).encode()])
    task.refresh_from_db()
    assert task.state == "TASK_STATE_INPUT_REQUIRED"
    assert (task.watcher_status, task.watcher_note) == ("idle", "waiting for an answer")
    assert task.lease_token == "" and task.lease_expires_at > timezone.now() + timedelta(
        seconds=settings.WATCH_QUESTION_RECHECK_SECONDS - 60
    )
    working = {"state": "TASK_STATE_WORKING", "timestamp": "2026-01-01T00:00:03Z"}
    event = {"statusUpdate": {"taskId": task.remote_id, "contextId": "c", "status": working}}
    # Working again (answered from elsewhere): followed by push as before.
    push.record_batch([json.dumps({"c": config.pk, "t": task.pk, "e": event}).encode()])
    task.refresh_from_db()
    assert task.watcher_status == RemoteTask.WatcherStatus.AWAITING_PUSH
