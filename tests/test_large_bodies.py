"""Large replies read at once on one event loop are bounded, whatever the agent sends.

A reply of up to 32 MiB (a task holding a large artifact returns it on every GetTask) costs
about three times its size while it is read, joined, decoded and parsed, and the parsed
value lives on until it is recorded. Any number were read at once on a worker's loop, so
an agent with many such tasks set the worker's memory. A body past ``LARGE_BODY_BYTES``
now waits for one of ``LARGE_BODIES_AT_ONCE`` slots of its origin on its loop, held through
its parse (and, in a ``large_body_scope``, its recording); smaller replies never wait, nor
another agent's. An SSE event past that size takes a slot too, and a watcher's stream keeps
it until the event is recorded. Raw HTTP servers on 127.0.0.1 (tests/hostile_servers.py,
modes ``big`` and ``bigsse``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from tasks_app.a2a import StreamEvent, large_body_scope
from tasks_app.a2a import _http as http_layer
from tests.hostile_servers import TASK_ID, HostileServer
from tests.test_hostile_protocol import hostile_client

BIG = 8 * 1024 * 1024
CALLS = 6


def running_server(big_bytes: int) -> Iterator[HostileServer]:
    running = HostileServer(big_bytes=big_bytes).start()
    try:
        yield running
    finally:
        running.close()


@pytest.fixture(scope="module")
def server() -> Iterator[HostileServer]:
    yield from running_server(BIG)


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_large_replies_read_at_once_hold_at_most_the_loops_slots(
    server,
    http,
    binding,
):
    client = hostile_client(server, "big", binding, http)
    await client.get_task(TASK_ID)  # connections and imports, before memory is traced
    holding = []  # how many scopes hold a parsed large reply, after each read
    inside = 0

    async def poll() -> int:
        nonlocal inside
        async with large_body_scope():  # as a watcher's poll: read, then record
            task = await client.get_task(TASK_ID)
            inside += 1
            holding.append(inside)
            await asyncio.sleep(0.05)  # the recording
            inside -= 1
            return len(task["artifacts"][0]["parts"][0]["text"])

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        sizes = await asyncio.gather(*(poll() for _ in range(CALLS)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sizes == [BIG] * CALLS  # every reply read whole, in turn
    assert max(holding) <= http_layer.LARGE_BODIES_AT_ONCE, holding
    # Two at a time, each about three times its size at its peak, and the others' first
    # megabyte waiting: well under what six at once took (about 18 times the body).
    assert peak < (3 * http_layer.LARGE_BODIES_AT_ONCE + 3) * BIG, peak / BIG


async def test_a_small_reply_and_another_agents_large_one_are_not_held_behind_them(
    server,
    http,
):
    """The slots are per origin: an agent that trickles its large replies (or whose tasks'
    recording waits) holds its own slots, never another agent's."""
    client = hostile_client(server, "big", "JSONRPC", http)
    small = hostile_client(server, "newids", "JSONRPC", http)
    other_agent = HostileServer(big_bytes=BIG).start()
    release = asyncio.Event()

    async def hold() -> None:
        async with large_body_scope():
            await client.get_task(TASK_ID)
            await release.wait()

    holders = [asyncio.create_task(hold()) for _ in range(http_layer.LARGE_BODIES_AT_ONCE)]
    try:
        for _ in range(3000):  # within 30 s
            if slots_taken(server):
                break
            await asyncio.sleep(0.01)
        assert slots_taken(server)
        # Every slot is held: a small reply still comes, a large one waits for a slot.
        answer = await asyncio.wait_for(small.get_task(TASK_ID, history_length=5), 30)
        assert len(answer["history"]) == 5
        elsewhere = hostile_client(other_agent, "big", "JSONRPC", http)
        task = await asyncio.wait_for(elsewhere.get_task(TASK_ID), 30)
        assert len(task["artifacts"][0]["parts"][0]["text"]) == BIG
        waiting = asyncio.create_task(client.get_task(TASK_ID))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        release.set()
        task = await asyncio.wait_for(waiting, 30)
        assert len(task["artifacts"][0]["parts"][0]["text"]) == BIG
    finally:
        release.set()
        await asyncio.gather(*holders, return_exceptions=True)
        other_agent.close()


def slots_taken(server: HostileServer) -> bool:
    """Whether every large-body slot of ``server``'s origin on the running loop is taken."""
    gates = http_layer._gates.get(asyncio.get_running_loop(), {})
    gate = gates.get(f"http://127.0.0.1:{server.port}")
    return gate is not None and gate.locked()


# Streams ------------------------------------------------------------------------------------
#
# An SSE event is a body too: many streams of one agent, each sending large events, were
# each bounded alone (8 MiB an event), so the agent held that many at once on a worker.

STREAM_BIG = 3 * 1024 * 1024 // 2  # past LARGE_BODY_BYTES
STREAMS = 5


@pytest.fixture(scope="module")
def stream_server() -> Iterator[HostileServer]:
    yield from running_server(STREAM_BIG)


def big_text(event: StreamEvent) -> str:
    """The text of a ``bigsse`` artifact chunk ("" for the other events)."""
    if event.kind != "artifactUpdate":
        return ""
    return event.payload["artifact"]["parts"][0]["text"]


@pytest.mark.parametrize("scoped", [True, False], ids=["in-a-scope", "plain-consumer"])
async def test_large_stream_events_of_one_agent_are_held_a_slots_worth_at_a_time(
    stream_server,
    http,
    scoped,
):
    """Five streams at once, three 1.5 MiB events each: at most the origin's slots' worth of
    parsed large events are in their consumers' hands at any moment. In a scope (as the
    watcher's reader) the slot is kept until the block ends; a plain consumer (the CLI)
    keeps it until it asks for the next event."""
    client = hostile_client(stream_server, "bigsse", "JSONRPC", http)
    holding: list[int] = []
    inside = 0

    async def consume() -> list[str]:
        nonlocal inside
        seen: list[str] = []
        stream = client.subscribe_to_task(TASK_ID)
        async with contextlib.aclosing(stream):
            while True:
                async with large_body_scope() if scoped else contextlib.nullcontext():
                    try:
                        event = await anext(stream)
                    except StopAsyncIteration:
                        break
                    if text := big_text(event):
                        inside += 1
                        holding.append(inside)
                        await asyncio.sleep(0.05)  # the recording
                        inside -= 1
                        seen.append(f"{text[:5]}{len(text) - 5}")
        return seen

    streams = await asyncio.wait_for(asyncio.gather(*(consume() for _ in range(STREAMS))), 120)
    whole = [f"big-{i}{STREAM_BIG}" for i in range(stream_server.bigsse_events)]
    assert streams == [whole] * STREAMS  # every event read whole, in order
    assert max(holding) <= http_layer.LARGE_BODIES_AT_ONCE, holding
    assert not slots_taken(stream_server)  # every slot given back


async def test_a_stream_waiting_for_a_slot_is_not_cut_by_its_event_deadline(
    stream_server,
    http,
):
    """Waiting for a slot is the worker's time, not the agent's: a stream whose large event
    waits longer than its event deadline still reads it (the deadline would cut it off if
    the agent took that long)."""
    holder_client = hostile_client(stream_server, "big", "JSONRPC", http)
    release = asyncio.Event()

    async def hold() -> None:
        async with large_body_scope():
            await holder_client.get_task(TASK_ID)
            await release.wait()

    holders = [asyncio.create_task(hold()) for _ in range(http_layer.LARGE_BODIES_AT_ONCE)]
    client = hostile_client(stream_server, "bigsse", "JSONRPC", http, call_deadline=1.0)
    try:
        for _ in range(3000):
            if slots_taken(stream_server):
                break
            await asyncio.sleep(0.01)
        assert slots_taken(stream_server)

        async def read_all() -> list[int]:
            return [len(big_text(e)) async for e in client.subscribe_to_task(TASK_ID)]

        reading = asyncio.create_task(read_all())
        await asyncio.sleep(2.0)  # twice the event deadline, waiting for a slot
        assert not reading.done()
        release.set()
        sizes = await asyncio.wait_for(reading, 60)
        assert [s for s in sizes if s] == [STREAM_BIG + 5] * stream_server.bigsse_events
    finally:
        release.set()
        await asyncio.gather(*holders, return_exceptions=True)


@pytest.mark.django_db(transaction=True)
def test_a_watchers_stream_keeps_a_large_events_slot_until_it_is_recorded(
    stream_server, shared_loop, monkeypatch
):
    """Four watchers' streams of one agent's origin, recorded slowly: between its read and
    its recording, a large event is in the worker's hands; at most the origin's slots' worth
    are, over all the streams. (Without the reader's scope, each stream read its next large
    event while the last one waited in the queue for the recorder.)"""
    import threading

    from tasks_app import eventloop, watchers
    from tasks_app.a2a import A2AClient, Interface
    from tasks_app.models import Agent, RemoteTask
    from tasks_app.services import tasks as task_services
    from tasks_app.services.record import Batch
    from tests.serving import loopback_client

    lock = threading.Lock()
    in_hand = 0
    peaks: list[int] = []
    real_record_many = watchers.record_many

    def slow_record_many(task_pk: int, batch: Batch, channel: str, **kw: object):
        nonlocal in_hand
        time.sleep(0.1)  # a slow database
        result = real_record_many(task_pk, batch, channel, **kw)
        with lock:
            in_hand -= sum(1 for raw in batch.objs if "artifactUpdate" in raw)
        return result

    monkeypatch.setattr(watchers, "record_many", slow_record_many)

    async def counted(stream):
        nonlocal in_hand
        async with contextlib.aclosing(stream):
            async for event in stream:
                if big_text(event):
                    with lock:
                        in_hand += 1
                        peaks.append(in_hand)
                yield event

    async def look(pk: int, token: str) -> watchers.Outcome:
        holder = watchers.Holder(pk, token, http=None)
        holder._take(await eventloop.db(RemoteTask.objects.get, pk=pk))  # as _hold does
        holder.streaming, holder.remote_id, holder.state = True, TASK_ID, "TASK_STATE_WORKING"
        await holder._go(watchers.Event.FOLLOW)
        async with loopback_client() as http_client:
            client = A2AClient(
                Interface(url=stream_server.url_for("bigsse"), binding="JSONRPC"), http=http_client
            )
            events = counted(client.subscribe_to_task(TASK_ID))
            return await holder._pump(events, "resubscribe", "stream")

    pks = []
    for i in range(4):
        agent = Agent.objects.create(
            name=f"big {i}", base_url=f"{stream_server.url_for('bigsse')}/{i}/"
        )
        pks.append(
            RemoteTask.objects.create(
                agent=agent, title="t", remote_id=TASK_ID, context_id="ctx-hostile",
                phase=RemoteTask.Phase.TASK, state="TASK_STATE_WORKING",
                watch=RemoteTask.Watch.STREAM,
            ).pk
        )  # fmt: skip
    tokens = {pk: task_services.acquire_lease(pk, watchers.OWNER) for pk in pks}

    async def all_looks() -> list[watchers.Outcome]:
        return await asyncio.gather(*(look(pk, tokens[pk]) for pk in pks))

    outcomes = eventloop.submit(all_looks()).result(timeout=120)
    assert all(outcome.progress for outcome in outcomes)
    for pk in pks:
        task = RemoteTask.objects.get(pk=pk)
        assert task.state == "TASK_STATE_COMPLETED"
        assert task.artifacts.get().part_count == stream_server.bigsse_events
    assert len(peaks) == 4 * stream_server.bigsse_events
    assert max(peaks) <= http_layer.LARGE_BODIES_AT_ONCE, peaks
