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
import math
from collections import Counter
from collections.abc import Iterable

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError as RedisResponseError

from tasks_app import metrics
from tasks_app.runtime.logs import FailureSpell

log = logging.getLogger(__name__)

LIST_GROUP = "tasks"

Message = tuple[str, dict]
SENDS_IN_FLIGHT = 32
# A takeover's backlog (a thousand tasks) goes to list pages in messages of bounded size.
SUMMARIES_PER_MESSAGE = 200
# A group's sends go out at most this often (seconds): list summaries, and the rest
# (a task's rows, a person's news); see _LoopRelay.
SUMMARIES_EVERY = 0.2
ROWS_EVERY = 0.025
# When the loop stops: how long what is still queued or held may take to go (see close()).
CLOSE_SECONDS = 2.0
# How long one group send (the loop's) or one publish's sends (the synchronous way) may
# take before they count as failed. The layer's connections have no socket timeout (idle
# consumers need that: dashboard/settings.py), so a Redis that takes connections and
# answers nothing (paused, partitioned) held every later relay of a worker behind one
# send, its queue growing, and a web request's relay after its commit, for ever.
SEND_SECONDS = 5.0


def task_group(task_pk: int) -> str:
    return f"task-{task_pk}"


def person_group(user_pk: int) -> str:
    """Every socket of one person: told when what that person may read changes."""
    return f"person-{user_pk}"


class _LoopRelay:
    """Sends queued messages from the loop: in order within a group, groups side by side.

    Whatever has queued up is taken at once, and each group's messages go out in
    order on their own coroutine, so one slow group does not hold up the others.
    Each group is paced: at most one send per spell (``ROWS_EVERY`` for a task's
    and a person's group, ``SUMMARIES_EVERY`` for the list). What comes after a
    quiet spell goes at once; what follows within the spell waits for its end and
    goes as one send (rows appended in order, list summaries coalesced to the
    newest per task). A group send costs about a millisecond of this process's CPU
    whatever it carries (four Redis round trips in channels_redis, measured alone),
    and a fast stream sent its rows and a list summary after every batch: 200 sends
    for 10,000 events, about 65 now (P3).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[Message] | None] = asyncio.Queue()  # None: closing
        self.task: asyncio.Task[None] | None = None
        # Group sends in flight at once: each holds a Redis connection. Unbounded, a backlog
        # of a thousand tasks' messages (a worker taking over another's streams) asked for
        # a thousand connections at once and most sends failed on the pool's limit.
        self.sending = asyncio.Semaphore(SENDS_IN_FLIGHT)
        self.held: dict[str, list[dict]] = {}  # group -> messages waiting for its spell's end
        self.summaries: dict[object, dict] = {}  # held list summaries, newest per task
        self.spells: dict[str, float] = {}  # group -> loop time at which its spell ends
        self.wake_at: float | None = None  # a wake-up for held messages is scheduled then
        # Sends failing (Redis down): one traceback, then a count, then one line when a send
        # works again; with Redis down every send fails at once, and a busy worker sends for
        # hundreds of groups a second (browsers catch up from the log).
        self.failures = FailureSpell(
            log,
            "relay to %s failed; further failures are counted until a send works",
            "relay works again: %d sends failed over %.1f s",
        )

    def start(self) -> None:
        if self.task is None:
            self.task = self.loop.create_task(self._run())

    def put(self, messages: list[Message]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, messages)

    async def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Send what is queued and held now, spells or not: the loop is stopping.

        Called in the loop once it stopped running and the relay was released (later
        messages go the synchronous way): the rows of a fast stream's last spell and the
        list's last summaries reach browsers instead of waiting for their re-sync.
        Everything put before the release is queued ahead of the closing mark. What is
        not sent within ``timeout`` is dropped (a Redis that does not answer must not
        hold a worker's shutdown).
        """
        if self.task is None or self.task.done():
            return
        self.queue.put_nowait(None)
        await asyncio.wait({self.task}, timeout=timeout)

    async def _run(self) -> None:
        layer = get_channel_layer()
        closing = False
        while not closing:
            batch: list[Message] = []
            first = await self.queue.get()
            for messages in [first, *(self.queue.get_nowait() for _ in range(self.queue.qsize()))]:
                if messages is None:
                    closing = True
                else:
                    batch.extend(messages)
            for group, message in batch:
                if group == LIST_GROUP and message.get("type") == "tasks.changed":
                    self._hold(message)
                else:
                    self.held.setdefault(group, []).append(message)
            due = self._due(closing=closing)
            await asyncio.gather(*(self._send(layer, group, items) for group, items in due.items()))

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

    def _due(self, *, closing: bool = False) -> dict[str, list[dict]]:
        """What may go now, by group (each such group's spell starts again); for what must
        wait, a wake-up at the earliest end of its spell. ``closing``: everything held.

        1. Spells that have ended are forgotten.
        2. A group with held messages and no spell running goes now, and starts one.
        3. The held list summaries go the same way, as one message per
           ``SUMMARIES_PER_MESSAGE`` (``summarize``), with the list's own spell.
        4. If anything is still held, the loop is woken when the first of their spells ends
           (an empty batch: ``_run`` then sends what is due).
        """
        now = math.inf if closing else self.loop.time()
        if len(self.spells) > len(self.held) + 1:  # 1 (cheap while few groups are busy)
            self.spells = {group: end for group, end in self.spells.items() if end > now}
        due: dict[str, list[dict]] = {}
        for group in list(self.held):  # 2
            if self.spells.get(group, 0.0) <= now:
                due[group] = self.held.pop(group)
                self.spells[group] = now + ROWS_EVERY
        if self.summaries and self.spells.get(LIST_GROUP, 0.0) <= now:  # 3
            due[LIST_GROUP] = summarize(self.summaries)
            self.summaries = {}
            self.spells[LIST_GROUP] = now + SUMMARIES_EVERY
        waiting = [self.spells[group] for group in self.held]  # 4
        if self.summaries:
            waiting.append(self.spells[LIST_GROUP])
        if waiting:
            first = min(waiting)
            if self.wake_at is None or first < self.wake_at or self.wake_at <= now:
                self.wake_at = first
                self.loop.call_at(first, self._wake)
        return due

    def _wake(self) -> None:
        self.wake_at = None
        self.queue.put_nowait([])  # an empty batch: _run sends what is due

    async def _send(self, layer: object, group: str, messages: list[dict]) -> None:
        for message in pack(messages):
            try:
                async with self.sending:
                    await asyncio.wait_for(
                        layer.group_send(group, message),  # type: ignore[attr-defined]
                        SEND_SECONDS,
                    )
            except Exception:  # a relay failure must not stop later messages
                self.failures.failed(group)
            else:
                self.failures.worked()
                _observe(message)

    @property
    def failed_sends(self) -> int:
        return self.failures.count


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


def release_loop(loop: asyncio.AbstractEventLoop) -> _LoopRelay | None:
    """Unregister ``loop`` if it is still the one registered (a stopped loop's thread calls
    this; a loop started since then keeps its registration). Returns the relay released,
    for its :meth:`_LoopRelay.close`."""
    global _loop_relay
    if _loop_relay is not None and _loop_relay.loop is loop:
        released, _loop_relay = _loop_relay, None
        return released
    return None


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

    async def send_all_in_time() -> None:
        await asyncio.wait_for(send_all(), SEND_SECONDS)

    try:
        async_to_sync(send_all_in_time)()
    except (OSError, TimeoutError, RedisConnectionError) as exc:
        # Redis down or slow: one line (a command run with Redis down printed a traceback),
        # and one for the whole spell (a web process said it at every answer and action).
        _unreachable.failed(type(exc).__name__)
    except RedisResponseError as exc:
        # Redis refused the command (REDIS_URL names a database it does not have, say): its
        # own words, one line; they hold no secret.
        log.warning("relay failed (Redis said: %s); browsers catch up from the log", exc)
    except Exception:  # the log is the truth; browsers catch up from it on reconnect
        log.exception("relay failed")
    else:
        _unreachable.worked()


# The synchronous relay's spells of Redis being away (see ``publish``).
_unreachable = FailureSpell(
    log,
    "relay failed (%s); browsers catch up from the log; further failures are counted",
    "relay works again: %d sends failed over %.1f s",
    traceback=False,
)
