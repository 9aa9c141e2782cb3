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
from collections import Counter
from collections.abc import Iterable

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from tasks_app import metrics

log = logging.getLogger(__name__)

LIST_GROUP = "tasks"

Message = tuple[str, dict]
SENDS_IN_FLIGHT = 32
# A takeover's backlog (a thousand tasks) goes to list pages in messages of bounded size.
SUMMARIES_PER_MESSAGE = 200
# List summaries go out at most this often (seconds); see _LoopRelay.
SUMMARIES_EVERY = 0.2


def task_group(task_pk: int) -> str:
    return f"task-{task_pk}"


def person_group(user_pk: int) -> str:
    """Every socket of one person: told when what that person may read changes."""
    return f"person-{user_pk}"


class _LoopRelay:
    """Sends queued messages from the loop: in order within a group, groups side by side.

    Whatever has queued up is taken at once, and each group's messages go out in
    order on their own coroutine, so one slow group does not hold up the others.
    List summaries are coalesced (only a task's newest matters) and sent at most
    every ``SUMMARIES_EVERY`` seconds: one that comes after a quiet spell goes at
    once, and those that follow within the spell wait for its end. A group send
    costs about a millisecond of this process's CPU whatever it carries (four Redis
    round trips in channels_redis, measured alone), and a fast stream sent a list
    summary beside every batch of its events: 200 sends for 10,000 events, 112 now.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[Message]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        # Group sends in flight at once: each holds a Redis connection. Unbounded, a backlog
        # of a thousand tasks' messages (a worker taking over another's streams) asked for
        # a thousand connections at once and most sends failed on the pool's limit.
        self.sending = asyncio.Semaphore(SENDS_IN_FLIGHT)
        self.summaries: dict[object, dict] = {}  # held until summaries_at, newest per task
        self.summaries_at = 0.0  # loop time from which the next summaries may go
        self.summaries_waiting = False  # a wake-up for the held summaries is scheduled

    def start(self) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self._run())

    def put(self, messages: list[Message]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, messages)

    async def _run(self) -> None:
        layer = get_channel_layer()
        while True:
            batch = list(await self.queue.get())
            while not self.queue.empty():
                batch.extend(self.queue.get_nowait())
            by_group: dict[str, list[dict]] = {}
            for group, message in batch:
                if group == LIST_GROUP and message.get("type") == "tasks.changed":
                    self._hold(message)
                else:
                    by_group.setdefault(group, []).append(message)
            summaries = self._due_summaries()
            if summaries:
                by_group[LIST_GROUP] = [*by_group.get(LIST_GROUP, []), *summarize(summaries)]
            await asyncio.gather(
                *(self._send(layer, group, items) for group, items in by_group.items())
            )

    def _hold(self, summary: dict) -> None:
        """Hold a summary until the spell's end, unless a newer one of its task is held.

        Summaries are put from several threads (each ``record()`` and watcher change
        publishes after its own commit), so the last one put can be the older: a watcher
        change read before a record's commit and put after it. Browsers drop a summary
        whose ``last_seq`` is behind one they showed, but a held summary that is replaced
        never reaches them, and the list would show the older state until its re-sync.
        """
        task = summary.get("task")
        held = self.summaries.pop(task, None)
        if held is not None and _seq(held) > _seq(summary):
            summary = held
        self.summaries[task] = summary  # (re)inserted last: the send order follows change

    def _due_summaries(self) -> dict[object, dict]:
        """The held summaries when their time has come (the clock restarts); else none,
        with a wake-up scheduled for when it comes."""
        if not self.summaries:
            return {}
        now = self.loop.time()
        if now >= self.summaries_at:
            due, self.summaries = self.summaries, {}
            self.summaries_at = now + SUMMARIES_EVERY
            return due
        if not self.summaries_waiting:
            self.summaries_waiting = True
            self.loop.call_at(self.summaries_at, self._wake_for_summaries)
        return {}

    def _wake_for_summaries(self) -> None:
        self.summaries_waiting = False
        self.queue.put_nowait([])  # an empty batch: _run sends what is due

    async def _send(self, layer: object, group: str, messages: list[dict]) -> None:
        for message in pack(messages):
            try:
                async with self.sending:
                    await layer.group_send(group, message)  # type: ignore[attr-defined]
            except Exception:  # a relay failure must not stop later messages
                log.exception("relay to %s failed", group)
            else:
                _observe(message)


def _seq(summary: dict) -> int:
    seq = summary.get("last_seq")
    return seq if isinstance(seq, int) else 0


def _observe(message: dict) -> None:
    """Relay latency (commit to send) of each entry a sent message carried."""
    if message.get("type") == "task.event":
        metrics.observe_relay_latency(message.get("received_at"))
    elif message.get("type") == "task.events":
        # A batch's rows share their commit time: one observation per time, not per row.
        times = Counter(event.get("received_at") for event in message.get("events", ()))
        for received_at, entries in times.items():
            metrics.observe_relay_latency(received_at, entries)


def summarize(summaries: dict[object, dict]) -> list[dict]:
    """The list summaries of one batch as one message (per SUMMARIES_PER_MESSAGE).

    A group send costs up to four Redis round trips, and the batch after this one
    waits until every group of this one is sent: when a hundred tasks change in the
    same moment (they end together, a worker takes them over), a send per summary
    made a hundred sends one after another ahead of the next batch's events.
    """
    items = list(summaries.values())
    if len(items) == 1:
        return items
    return [
        {"type": "tasks.summaries", "summaries": items[start : start + SUMMARIES_PER_MESSAGE]}
        for start in range(0, len(items), SUMMARIES_PER_MESSAGE)
    ]


def pack(messages: list[dict]) -> list[dict]:
    """Runs of ``task.event`` messages become one ``task.events`` message (a fast stream
    then costs one channel-layer send per batch, not per event); order is kept."""
    packed: list[dict] = []
    run: list[dict] = []
    for message in [*messages, {}]:
        if message.get("type") == "task.event":
            run.append(message)
            continue
        if len(run) == 1:
            packed.append(run[0])
        elif run:
            packed.append({"type": "task.events", "events": run})
        run = []
        if message:
            packed.append(message)
    return packed


_loop_relay: _LoopRelay | None = None


def use_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Register (or with None, unregister) the loop that sends this process's relays.

    Must be called from inside that loop.
    """
    global _loop_relay
    _loop_relay = _LoopRelay(loop) if loop is not None else None
    if _loop_relay is not None:
        _loop_relay.start()


def release_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Unregister ``loop`` if it is still the one registered (a stopped loop's thread calls
    this; a loop started since then keeps its registration)."""
    global _loop_relay
    if _loop_relay is not None and _loop_relay.loop is loop:
        _loop_relay = None


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

    by_group: dict[str, list[dict]] = {}
    for group, message in batch:
        by_group.setdefault(group, []).append(message)

    async def send_all() -> None:
        for group, messages in by_group.items():
            for message in pack(messages):
                await layer.group_send(group, message)
                _observe(message)

    try:
        async_to_sync(send_all)()
    except Exception:  # the log is the truth; browsers catch up from it on reconnect
        log.exception("relay failed")
