"""Large replies read at once on one event loop are bounded, whatever the agent sends.

A reply of up to 32 MiB (a task holding a large artifact returns it on every GetTask) costs
about three times its size while it is read, joined, decoded and parsed, and the parsed
value lives on until it is recorded. Any number were read at once on a worker's loop, so
an agent with many such tasks set the worker's memory. A body past ``LARGE_BODY_BYTES``
now waits for one of ``LARGE_BODIES_AT_ONCE`` slots of its origin on its loop, held through
its parse (and, in a ``large_body_scope``, its recording); smaller replies never wait, nor
another agent's. Raw HTTP servers on 127.0.0.1 (tests/hostile_servers.py, mode ``big``).
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Iterator

import pytest

from tasks_app.a2a import _http as http_layer
from tasks_app.a2a import large_body_scope
from tests.hostile_servers import TASK_ID, HostileServer
from tests.test_hostile_protocol import hostile_client, http  # noqa: F401 (a fixture)

BIG = 8 * 1024 * 1024
CALLS = 6


@pytest.fixture(scope="module")
def server() -> Iterator[HostileServer]:
    running = HostileServer(big_bytes=BIG).start()
    try:
        yield running
    finally:
        running.close()


@pytest.mark.parametrize("binding", ["JSONRPC", "HTTP+JSON"])
async def test_large_replies_read_at_once_hold_at_most_the_loops_slots(
    server,
    http,  # noqa: F811 (the fixture)
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
    http,  # noqa: F811 (the fixture)
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
