"""Taking over a dead worker's streams: in batches, without deadlocks, without losing our own.

P2x (3,000 streams on three workers, one SIGKILLed) found three faults, each tested here in
the order where it broke:

- the reconciler sent one broker message per orphaned task, and the survivors took 20-40 s to
  work through a thousand of them: it now sends ``watch_batch`` messages of twenty;
- batches that overlap (two reconcile ticks, two workers) took their leases in a different
  order and PostgreSQL aborted them as deadlocks: ``acquire_leases`` skips rows another
  transaction holds;
- the lease heartbeat was a coroutine on the loop, and a loop busy starting a thousand holders
  woke it seconds late, so the survivors lost their *own* leases: it is a thread now, and
  renews while the loop is blocked.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import threading
import time
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.utils import timezone

from tasks_app import eventloop, relay, watchers
from tasks_app.models import Agent, RemoteTask
from tasks_app.runtime import shared_redis
from tasks_app.services import tasks as task_services

pytestmark = pytest.mark.django_db(transaction=True)


def _working_tasks(count: int) -> list[int]:
    agent = Agent.objects.create(name="takeover", base_url="http://127.0.0.1:9/takeover")
    created = RemoteTask.objects.bulk_create(
        RemoteTask(
            agent=agent,
            phase="task",
            remote_id=f"r-{i}",
            state="TASK_STATE_WORKING",
            watch="poll",
        )
        for i in range(count)
    )
    return sorted(task.pk for task in created)


def _queue() -> str:
    return settings.CELERY_TASK_DEFAULT_QUEUE


def _queued_messages() -> list[tuple[str, list]]:
    """What waits on this test's Celery queue in Redis (no worker listens to it): (task, args)."""
    client = shared_redis.client(settings.CELERY_BROKER_URL)
    out = []
    for raw in reversed(client.lrange(_queue(), 0, -1)):  # pushed left, taken from the right
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        out.append((message["headers"]["task"], args))
    return out


@pytest.fixture
def empty_queue(empty_push_queue: None) -> Iterator[None]:
    """No Celery message and no push notification waits (the reconciler's tick drains those)."""
    client = shared_redis.client(settings.CELERY_BROKER_URL)
    reconcile_key = f"dashboard:reconcile:{_queue()}"
    client.delete(_queue(), reconcile_key)
    yield
    client.delete(_queue(), reconcile_key)


def test_the_reconciler_hands_out_orphaned_tasks_twenty_to_a_message(empty_queue) -> None:
    pks = _working_tasks(41)
    assert watchers.reconcile_once() == 41
    messages = _queued_messages()
    assert [name for name, _ in messages] == ["tasks_app.watchers.watch_batch"] * 3
    batches = [args[0] for _, args in messages]
    assert [len(b) for b in batches] == [20, 20, 1]
    assert sorted(pk for batch in batches for pk in batch) == pks  # each task once


def test_overlapping_batches_released_at_once_take_each_lease_once() -> None:
    """Eight workers' batches over the same 60 tasks, each in its own order, started together:
    every task is won by exactly one of them, and no batch fails (PostgreSQL aborted such
    batches as deadlocks when they waited on each other's rows)."""
    pks = _working_tasks(60)
    barrier = threading.Barrier(8)
    won: list[dict[int, str]] = []
    errors: list[BaseException] = []

    def take(seed: int) -> None:
        order = pks[:]
        random.Random(seed).shuffle(order)
        barrier.wait()
        try:
            won.append(task_services.acquire_leases(order, f"worker-{seed}"))
        except BaseException as exc:
            errors.append(exc)
        finally:
            from django.db import connection

            connection.close()

    threads = [threading.Thread(target=take, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    taken = [pk for batch in won for pk in batch]
    # A row skipped because another batch held it is that batch's: together they took all.
    assert sorted(taken) == pks
    tokens = dict(RemoteTask.objects.filter(pk__in=pks).values_list("pk", "lease_token"))
    for batch in won:
        for pk, token in batch.items():
            assert tokens[pk] == token


def test_a_batch_takes_only_leases_nobody_holds() -> None:
    pks = _working_tasks(5)
    held = task_services.acquire_lease(pks[0], "someone else")
    assert held is not None
    won = task_services.acquire_leases(pks, "me")
    assert sorted(won) == pks[1:]
    assert RemoteTask.objects.get(pk=pks[0]).lease_token == held
    assert task_services.acquire_leases(pks, "a third") == {}  # all held now


def _hold_quietly(registry: watchers.Registry, task_pk: int, token: str) -> asyncio.Task[None]:
    """Register a holder that does nothing but wait (what the heartbeat sees of a holder)."""

    async def register() -> asyncio.Task[None]:
        holder = watchers.Holder(task_pk, token, http=None)
        waiting = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        registry.holders[task_pk] = (holder, waiting)
        registry.ensure_heartbeat()
        return waiting

    return eventloop.submit(register()).result(timeout=10)


def _one_held_task(settings) -> tuple[int, str, watchers.Registry, asyncio.Task[None]]:
    """A task leased by this process for 1 s, a quiet holder of it, and a running heartbeat."""
    settings.WATCH_LEASE_SECONDS = 1.0
    (pk,) = _working_tasks(1)
    token = task_services.acquire_lease(pk, watchers.OWNER)
    assert token is not None
    registry = watchers.Registry()
    return pk, token, registry, _hold_quietly(registry, pk, token)


def test_leases_are_renewed_while_the_loop_is_blocked(shared_loop, settings) -> None:
    pk, token, registry, waiting = _one_held_task(settings)

    async def busy() -> None:
        time.sleep(3.5)  # the loop does nothing else for three and a half leases

    blocked = eventloop.submit(busy())
    soonest_expiry = None
    while not blocked.done():
        expires = RemoteTask.objects.get(pk=pk).lease_expires_at
        left = (expires - timezone.now()).total_seconds()
        soonest_expiry = left if soonest_expiry is None else min(soonest_expiry, left)
        time.sleep(0.1)
    blocked.result()
    # Never lapsed: renewed every third of a lease while the loop was stuck.
    assert soonest_expiry is not None and soonest_expiry > 0
    assert RemoteTask.objects.get(pk=pk).lease_token == token
    assert not waiting.done()
    registry.stopping.set()
    eventloop.submit(_cancel(waiting)).result(timeout=10)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_a_holder_whose_lease_was_taken_is_stopped_by_the_heartbeat(shared_loop, settings) -> None:
    pk, _token, registry, waiting = _one_held_task(settings)
    # Another worker took it (as after a lapse): the next beat cancels our holder.
    RemoteTask.objects.filter(pk=pk).update(lease_token="someone-else", lease_owner="other")
    deadline = time.monotonic() + 5
    while not waiting.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert waiting.cancelled()
    assert RemoteTask.objects.get(pk=pk).lease_token == "someone-else"  # not renewed by us
    registry.stopping.set()


def test_a_backlog_for_hundreds_of_groups_is_sent_with_a_bounded_number_of_connections(
    shared_loop,
) -> None:
    """A worker that took over hundreds of streams relays to hundreds of groups at once: every
    message arrives, with at most ``SENDS_IN_FLIGHT`` group sends (Redis connections) in flight.
    Unbounded, the pool's limit failed most of them."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    in_flight = peak = 0
    layer_class = type(layer)
    real_send = layer_class.group_send

    # On the class: the relay's loop holds the layer it got when it started, which is not
    # this test's instance when the settings (and so the cached layers) changed since.
    async def counting_send(self, group: str, message: dict) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await real_send(self, group, message)
        finally:
            in_flight -= 1

    groups = [f"takeover-{i}" for i in range(600)]

    async def listen() -> str:
        channel = await layer.new_channel()
        for group in groups:
            await layer.group_add(group, channel)
        return channel

    channel = eventloop.submit(listen()).result(timeout=60)
    layer_class.group_send = counting_send
    try:
        relay.publish([(group, {"type": "task.watcher", "i": i}) for i, group in enumerate(groups)])

        async def receive_all() -> set[int]:
            got: set[int] = set()
            while len(got) < len(groups):
                message = await asyncio.wait_for(layer.receive(channel), 30)
                got.add(message["i"])
            return got

        got = eventloop.submit(receive_all()).result(timeout=90)
    finally:
        layer_class.group_send = real_send

        async def leave() -> None:
            for group in groups:
                await layer.group_discard(group, channel)

        eventloop.submit(leave()).result(timeout=60)
    assert got == set(range(len(groups)))
    assert 1 < peak <= relay.SENDS_IN_FLIGHT <= 64


def test_a_holder_that_renews_after_its_lease_ran_out_shows_its_own_status_again(
    shared_loop, settings, empty_queue
) -> None:
    """The renewals met an outage: the lease ran out, a reconcile tick marked the row lost
    and dispatched a watcher, and the holder renewed before that watcher came. The holder
    goes on, so its row must say what it does, not "lost" until its status next changes
    (a quiet stream's does not change for a whole slice)."""
    pk, token, registry, waiting = _one_held_task(settings)
    holder, _ = registry.holders[pk]
    holder.status = watchers.Status.STREAMING
    RemoteTask.objects.filter(pk=pk).update(watcher_status=watchers.Status.STREAMING)
    registry.stopping.set()  # the renewals stop (the database is unreachable, say)
    deadline = time.monotonic() + 5
    while RemoteTask.objects.get(pk=pk).lease_expires_at > timezone.now():
        assert time.monotonic() < deadline, "the lease never ran out"
        time.sleep(0.05)
    assert watchers.reconcile_once() == 1  # the tick: marked lost, a watcher dispatched
    row = RemoteTask.objects.get(pk=pk)
    assert (row.watcher_status, row.lease_token) == (watchers.Status.LOST, token)
    registry.ensure_heartbeat()  # the database answers again: the next beat renews first
    deadline = time.monotonic() + 5
    while RemoteTask.objects.get(pk=pk).watcher_status == watchers.Status.LOST:
        assert time.monotonic() < deadline, "the row still says lost"
        time.sleep(0.05)
    row = RemoteTask.objects.get(pk=pk)
    assert (row.watcher_status, row.lease_token) == (watchers.Status.STREAMING, token)
    assert row.watcher_note == "its watcher answers again"
    assert row.lease_expires_at > timezone.now()
    assert not waiting.done()
    registry.stopping.set()
    eventloop.submit(_cancel(waiting)).result(timeout=10)


def test_a_task_with_nothing_left_to_watch_whose_holder_stopped_is_idle_not_lost(
    empty_queue,
) -> None:
    """A holder that could not release (the database away, the worker killed) left a task
    that had ended: the reconciler said "lost, taking over", but nobody takes over a task
    that is not watchable, and it said so for ever. One that waits for an answer is taken
    over (for a look at its question, ``WATCH_QUESTION_RECHECK_SECONDS``), as a working one."""
    from django.utils import timezone

    (ended, waiting, working) = _working_tasks(3)
    stopped = {"lease_token": "dead", "lease_owner": "gone-worker",
               "lease_expires_at": timezone.now(), "watcher_status": "streaming"}  # fmt: skip
    RemoteTask.objects.filter(pk=ended).update(
        state="TASK_STATE_COMPLETED", settled_at=timezone.now(), **stopped
    )
    RemoteTask.objects.filter(pk=waiting).update(state="TASK_STATE_INPUT_REQUIRED", **stopped)
    RemoteTask.objects.filter(pk=working).update(**stopped)
    watchers.reconcile_once()
    statuses = dict(RemoteTask.objects.values_list("pk", "watcher_status"))
    assert (statuses[ended], statuses[waiting], statuses[working]) == ("idle", "lost", "lost")
    assert RemoteTask.objects.get(pk=ended).lease_token == ""
    dispatched = [pk for _, args in _queued_messages() for pk in args[0]]
    assert sorted(dispatched) == sorted([waiting, working])
