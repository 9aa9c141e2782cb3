"""Relay: after a commit, tell browsers what was appended to a log.

Groups: ``task-<pk>`` carries every event of one task (with its ``seq``, so a
browser can tell a gap or a duplicate); ``tasks`` carries one summary per change
for lists and the overview.

In a watcher process a relay loop is registered (the shared asyncio loop that
holds the streams); messages are queued to it and sent in order by one
coroutine. Elsewhere (web requests, commands) they are sent synchronously.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)

LIST_GROUP = "tasks"

Message = tuple[str, dict]


def task_group(task_pk: int) -> str:
    return f"task-{task_pk}"


class _LoopRelay:
    """Sends queued messages from one coroutine, so their order is kept."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[Message]] = asyncio.Queue()
        self.task = loop.create_task(self._run()) if loop.is_running() else None

    def start(self) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self._run())

    def put(self, messages: list[Message]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, messages)

    async def _run(self) -> None:
        layer = get_channel_layer()
        while True:
            batch = await self.queue.get()
            for group, message in batch:
                try:
                    await layer.group_send(group, message)
                except Exception:  # a relay failure must not stop later messages
                    log.exception("relay to %s failed", group)

    async def drain(self) -> None:
        while not self.queue.empty():
            await asyncio.sleep(0.01)


_loop_relay: _LoopRelay | None = None


def use_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Register (or with None, unregister) the loop that sends this process's relays.

    Must be called from inside that loop.
    """
    global _loop_relay
    _loop_relay = _LoopRelay(loop) if loop is not None else None
    if _loop_relay is not None:
        _loop_relay.start()


def publish(messages: Iterable[Message]) -> None:
    batch = list(messages)
    if not batch:
        return
    if _loop_relay is not None:
        _loop_relay.put(batch)
        return
    layer = get_channel_layer()
    if layer is None:
        return

    async def send_all() -> None:
        for group, message in batch:
            await layer.group_send(group, message)

    try:
        async_to_sync(send_all)()
    except Exception:  # the log is the truth; browsers catch up from it on reconnect
        log.exception("relay failed")
