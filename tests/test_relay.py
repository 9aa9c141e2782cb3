"""The worker's relay loop: each group's sends paced, nothing lost or reordered.

A group send costs about a millisecond of the worker's CPU whatever it carries, and a
fast stream sent its rows and a list summary after every batch of its events. A group
now gets at most one send per spell (``relay.SUMMARIES_EVERY`` for the list,
``relay.ROWS_EVERY`` for a task's rows): the first after a quiet spell at once, the rest
of the spell in one send at its end (summaries coalesced to the newest per task, rows
all of them, in order).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from channels import DEFAULT_CHANNEL_LAYER
from channels.layers import channel_layers, get_channel_layer

from tasks_app import eventloop, relay


@pytest.fixture
def relay_loop() -> Iterator[None]:
    if eventloop.running():  # a loop an earlier test left: a relay of its own, its own clock
        eventloop.stop()
    # The layer first: the relay's sender and this thread must share one. Asked for the
    # first time from both threads at once, each could make its own (another client
    # prefix: a channel made by one is refused by the other's receive).
    get_channel_layer()
    eventloop.get_loop()  # registers the shared loop's relay, a new one
    yield
    if eventloop.running():
        eventloop.stop()
    relay.use_loop(None)


def _listen(groups: list[str]) -> str:
    layer = get_channel_layer()

    async def join() -> str:
        channel = await layer.new_channel()
        for group in groups:
            await layer.group_add(group, channel)
        return channel

    return eventloop.submit(join()).result(timeout=30)


def _receive(channel: str, count: int) -> list[dict]:
    layer = get_channel_layer()

    async def take() -> list[dict]:
        return [await asyncio.wait_for(layer.receive(channel), 10) for _ in range(count)]

    return eventloop.submit(take()).result(timeout=30)


def _nothing_more(channel: str, within: float) -> bool:
    layer = get_channel_layer()

    async def wait() -> bool:
        try:
            await asyncio.wait_for(layer.receive(channel), within)
        except TimeoutError:
            return True
        return False

    return eventloop.submit(wait()).result(timeout=within + 10)


def _summary(task: int, seq: int) -> relay.Message:
    return (relay.LIST_GROUP, {"type": "tasks.changed", "task": task, "last_seq": seq})


def test_summaries_in_a_burst_go_as_one_send_with_the_newest_of_each_task(
    relay_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A spell far longer than the test's publishing takes: the burst is certainly inside it.
    monkeypatch.setattr(relay, "SUMMARIES_EVERY", 1.0)
    channel = _listen([relay.LIST_GROUP, relay.task_group(7)])
    relay.publish([_summary(7, 1)])  # after a quiet spell: at once
    (first,) = _receive(channel, 1)
    assert first == {"type": "tasks.changed", "task": 7, "last_seq": 1}
    for seq in range(2, 12):  # a fast stream's batches, each with its summary
        relay.publish([(relay.task_group(7), {"type": "task.event", "seq": seq}), _summary(7, seq)])
    relay.publish([_summary(8, 1)])
    relay.publish([_summary(8, 2)])
    # Task events are not held back by the pacing: all ten arrive, in order (batches that
    # queued together are packed into one ``task.events``).
    # The burst's summaries: one send, after the spell, the newest of each task.
    seqs: list[int] = []
    summaries: list[dict] = []
    while len(seqs) < 10 or not summaries:
        (message,) = _receive(channel, 1)
        if message["type"].startswith("tasks."):
            summaries.append(message)
        else:
            assert not summaries, "a task row waited for the list's spell"
            seqs += [e["seq"] for e in message.get("events", [message])]
    assert seqs == list(range(2, 12))
    (second,) = summaries
    assert second["type"] == "tasks.summaries"
    assert second["summaries"] == [
        {"type": "tasks.changed", "task": 7, "last_seq": 11},
        {"type": "tasks.changed", "task": 8, "last_seq": 2},
    ]
    assert _nothing_more(channel, 1.0)  # two list sends in all: the first, then the burst


def test_a_summary_after_a_quiet_spell_is_not_held(
    relay_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay, "SUMMARIES_EVERY", 0.2)
    list_channel = _listen([relay.LIST_GROUP])
    relay.publish([_summary(3, 1)])
    assert _receive(list_channel, 1) == [{"type": "tasks.changed", "task": 3, "last_seq": 1}]
    assert _nothing_more(list_channel, 0.5)  # the spell passes with nothing held
    relay.publish([_summary(3, 2)])
    assert _receive(list_channel, 1) == [{"type": "tasks.changed", "task": 3, "last_seq": 2}]


def test_a_held_summary_is_not_replaced_by_an_older_one_of_its_task(relay_loop: None) -> None:
    """Summaries are put from several threads, so an older one can be put after a newer
    one (a watcher change read before a record's commit). What is held keeps the newer;
    at the same seq (a watcher change does not move last_seq) the later one."""
    channel = _listen([relay.LIST_GROUP])
    parked = {"type": "tasks.changed", "task": 6, "last_seq": 2, "watcher_status": "parked"}
    # Taken by the relay as one batch (one publish): held together, sent together at once.
    relay.publish(
        [
            _summary(5, 4),  # input-required, committed
            _summary(5, 3),  # read before that commit, put after it
            _summary(6, 2),
            (relay.LIST_GROUP, parked),
        ]
    )
    (held,) = _receive(channel, 1)
    assert held["summaries"] == [{"type": "tasks.changed", "task": 5, "last_seq": 4}, parked]
    assert _nothing_more(channel, 0.3)


def _row(task: int, seq: int) -> relay.Message:
    return (relay.task_group(task), {"type": "task.event", "task": task, "seq": seq})


def _seqs(messages: list[dict]) -> list[int]:
    return [e["seq"] for message in messages for e in message.get("events", [message])]


def test_rows_of_a_fast_task_go_once_per_spell_in_order_and_other_tasks_are_not_held(
    relay_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A spell far longer than the test's publishing takes: the burst is certainly inside it.
    monkeypatch.setattr(relay, "ROWS_EVERY", 1.0)
    fast = _listen([relay.task_group(1)])
    other = _listen([relay.task_group(2)])

    def at_once(channel: str) -> list[int]:
        started = time.monotonic()
        seqs = _seqs(_receive(channel, 1))
        assert time.monotonic() - started < 0.7, "held for a spell"
        return seqs

    relay.publish([_row(1, 1)])  # after a quiet spell: at once
    assert at_once(fast) == [1]
    for seq in range(2, 7):  # a fast stream's batches, one publish each
        relay.publish([_row(1, seq)])
    relay.publish([_row(2, 1)])  # another task's group has no spell running: at once
    assert at_once(other) == [1]
    assert _nothing_more(fast, 0.2)  # the rest of task 1's spell waits for its end...
    (burst,) = _receive(fast, 1)  # ...and goes as one send, every row, in order
    assert burst["type"] == "task.events" and _seqs([burst]) == [2, 3, 4, 5, 6]
    assert _nothing_more(fast, 1.2)  # nothing is sent twice, and no wake-up sends more
    relay.publish([_row(1, 7)])  # the spell has passed with nothing held: at once again
    assert at_once(fast) == [7]


class _Listener:
    """A layer of its own on a loop of its own: it outlives the shared loop it listens to."""

    def __init__(self) -> None:
        self.layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def join(self, group: str) -> str:
        async def join() -> str:
            channel = await self.layer.new_channel()
            await self.layer.group_add(group, channel)
            return channel

        return self.run(join())

    def take(self, channel: str, within: float = 10) -> dict:
        return self.run(asyncio.wait_for(self.layer.receive(channel), within))

    def close(self) -> None:
        self.run(self.layer.flush())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        # Closed here: a loop left to the garbage collector is closed wherever that happens,
        # and channels_redis's close then runs this loop inside whatever loop runs there.
        self.loop.close()


def test_what_is_held_when_the_loop_stops_is_sent_not_dropped(
    relay_loop: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that shuts down sends the rest of its spells: the rows and the newest list
    summary of a fast stream's last moments reach browsers, not only their re-sync."""
    monkeypatch.setattr(relay, "ROWS_EVERY", 60.0)  # held far longer than the test takes
    monkeypatch.setattr(relay, "SUMMARIES_EVERY", 60.0)
    listener = _Listener()
    try:
        rows = listener.join(relay.task_group(1))
        summaries = listener.join(relay.LIST_GROUP)
        relay.publish([_row(1, 1), _summary(1, 1)])  # after a quiet spell: at once
        assert _seqs([listener.take(rows)]) == [1]
        assert listener.take(summaries)["last_seq"] == 1
        for seq in range(2, 6):
            relay.publish([_row(1, seq), _summary(1, seq)])
        with pytest.raises(TimeoutError):  # held for the spell
            listener.take(rows, within=0.3)
        started = time.monotonic()
        eventloop.stop()
        assert time.monotonic() - started < relay.CLOSE_SECONDS + 1
        burst = listener.take(rows)
        assert burst["type"] == "task.events" and _seqs([burst]) == [2, 3, 4, 5]
        assert listener.take(summaries)["last_seq"] == 5
    finally:
        listener.close()


@pytest.mark.subprocess  # starts a redis-server of its own, to take it down and bring it back
def test_a_redis_outage_logs_one_traceback_then_a_count_not_one_per_send(
    tmp_path, caplog, monkeypatch
) -> None:
    """Every group send fails at once while Redis is down, and a busy worker sends for
    hundreds of groups a second: a traceback each flooded the log."""
    import logging
    import subprocess

    from channels_redis.core import RedisChannelLayer

    from tasks_app.runtime.net import free_port, wait_until
    from tasks_app.runtime.redis_server import find_redis_server, redis_server_argv

    if eventloop.running():
        eventloop.stop()
    port = free_port()  # nothing listens there yet: the outage
    layer = RedisChannelLayer(hosts=[{"address": f"redis://127.0.0.1:{port}/0"}])
    monkeypatch.setitem(channel_layers.backends, DEFAULT_CHANNEL_LAYER, layer)
    monkeypatch.setattr(relay, "ROWS_EVERY", 0.0)  # every publish is a send of its own
    caplog.set_level(logging.WARNING, logger="tasks_app.relay")
    eventloop.get_loop()  # the relay takes the layer above
    server = None
    try:
        for task in range(60):
            relay.publish([_row(task, 1)])
        assert wait_until(lambda: relay._loop_relay.failed_sends >= 60, 30)
        failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(failures) == 1 and failures[0].exc_info is not None
        assert "further failures are counted" in failures[0].getMessage()
        # Redis is back: the next send works, and one line says how many failed.
        workdir = tmp_path / "redis"
        workdir.mkdir()
        server = subprocess.Popen(
            redis_server_argv(find_redis_server(), port, workdir), cwd=workdir,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        back = []

        def works() -> bool:
            relay.publish([_row(1000 + len(back), 1)])
            back.append(1)
            time.sleep(0.2)
            return any("relay works again" in r.getMessage() for r in caplog.records)

        assert wait_until(works, 30)
        (again,) = [r for r in caplog.records if "relay works again" in r.getMessage()]
        assert again.levelno == logging.WARNING and "sends failed over" in again.getMessage()
        assert int(again.getMessage().split(": ")[1].split()[0]) >= 60
        assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1
    finally:
        if eventloop.running():
            eventloop.stop()
        relay.use_loop(None)
        if server is not None:
            server.kill()
            server.wait(10)


def test_a_command_redis_refuses_is_one_line_not_a_traceback(monkeypatch, caplog) -> None:
    """A REDIS_URL naming a database Redis does not have (``/99999``) passed the settings,
    and a command's relay (``tasks start``, say) printed Redis's refusal with a traceback."""
    from redis.exceptions import ResponseError

    class Refusing:
        async def group_send(self, group: str, message: dict) -> None:
            raise ResponseError("DB index is out of range")

    monkeypatch.setattr(relay, "_loop_relay", None)  # the synchronous way, as in a command
    monkeypatch.setattr(relay, "get_channel_layer", lambda: Refusing())
    with caplog.at_level("WARNING", logger="tasks_app.relay"):
        relay.publish([("task-1", {"type": "task.event", "seq": 1})])
    (record,) = [r for r in caplog.records if r.name == "tasks_app.relay"]
    assert record.getMessage() == (
        "relay failed (Redis said: DB index is out of range); browsers catch up from the log"
    )
    assert record.exc_info is None


def test_a_spell_of_redis_away_is_one_line_then_one_when_it_is_back(monkeypatch, caplog) -> None:
    """The synchronous relay (a web process's answers and actions, a command's) said "relay
    failed" at every commit while Redis was down: one line per action, for as long as it lasted."""

    class Away:
        async def group_send(self, group: str, message: dict) -> None:
            raise ConnectionRefusedError(111, "Connection refused")

    class Back:
        sent: list[str] = []

        async def group_send(self, group: str, message: dict) -> None:
            self.sent.append(group)

    monkeypatch.setattr(relay, "_loop_relay", None)  # the synchronous way
    monkeypatch.setattr(relay, "_unreachable", relay.FailureSpell(
        relay.log, relay._unreachable.first, relay._unreachable.again, traceback=False
    ))  # fmt: skip
    monkeypatch.setattr(relay, "get_channel_layer", lambda: Away())
    with caplog.at_level("WARNING", logger="tasks_app.relay"):
        for seq in range(1, 6):
            relay.publish([("task-1", {"type": "task.event", "seq": seq})])
        back = Back()
        monkeypatch.setattr(relay, "get_channel_layer", lambda: back)
        relay.publish([("task-1", {"type": "task.event", "seq": 6})])
        relay.publish([("task-1", {"type": "task.event", "seq": 7})])
    lines = [r for r in caplog.records if r.name == "tasks_app.relay"]
    assert [r.getMessage().split(";")[0] for r in lines] == [
        "relay failed (ConnectionRefusedError)",
        "relay works again: 5 sends failed over " + lines[1].getMessage().split(" over ")[1],
    ]
    assert all(r.exc_info is None for r in lines) and back.sent == ["task-1", "task-1"]
