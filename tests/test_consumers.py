"""Websocket consumers: authentication, and resume-after-seq with no gap and no duplicate.

Real Redis channel layer under a private prefix (other test runs share the server),
real record() calls: the relay after commit is what the consumer forwards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.db import close_old_connections

from tasks_app import consumers
from tasks_app.models import Agent, Membership, RemoteTask, TaskEvent
from tasks_app.relay import task_group
from tasks_app.routing import websocket_urlpatterns
from tasks_app.services.record import record
from tests.people import member, signed_in

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def private_layer(settings):
    layer = dict(settings.CHANNEL_LAYERS["default"])
    layer["CONFIG"] = {**layer["CONFIG"], "prefix": f"uitest-{uuid.uuid4().hex[:8]}"}
    settings.CHANNEL_LAYERS = {"default": layer}
    yield


app = URLRouter(websocket_urlpatterns)


@pytest.fixture
def user(django_user_model):
    return member(django_user_model.objects.create_user(username="ws", password="pw-12345678"))


@pytest.fixture
def task(db) -> RemoteTask:
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:1/")
    return RemoteTask.objects.create(agent=agent, title="t")


def status(i: int, state: str = "TASK_STATE_WORKING") -> dict:
    return {
        "statusUpdate": {
            "taskId": "t-1",
            "contextId": "c-1",
            "status": {
                "state": state,
                "message": {
                    "messageId": f"m-{i}",
                    "role": "ROLE_AGENT",
                    "parts": [{"text": f"step {i}"}],
                },
            },
        }
    }


def write(task_pk: int, i: int) -> None:
    record(task_pk, status(i), "stream")


async def communicator(path: str, user) -> WebsocketCommunicator:
    comm = WebsocketCommunicator(app, path)
    await sync_to_async(signed_in)(comm.scope, user)
    return comm


async def refused_with(comm: WebsocketCommunicator) -> int | None:
    """The code a handshake is refused with: accepted, then closed at once with nothing sent
    (``consumers.refuse``: a close before the accept reaches a browser as 1006, no code).
    None when the socket stays open."""
    connected, code = await comm.connect(timeout=10)
    assert connected, f"closed before the accept with {code}: a browser would see 1006"
    if await comm.receive_nothing(timeout=0.3):
        return None
    closed = await comm.receive_output(timeout=1)
    assert closed["type"] == "websocket.close", closed
    assert await comm.receive_nothing(timeout=0.1)
    return closed["code"]


async def collect(comm: WebsocketCommunicator, until_seq: int, timeout: float = 10) -> list[dict]:
    """Event messages until ``until_seq`` is seen (other message types are skipped)."""
    out: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; got {[m.get('seq') for m in out]}"
        msg = await comm.receive_json_from(timeout=remaining)
        if msg["type"] == "event":
            out.append(msg)
            if msg["seq"] >= until_seq:
                return out


async def test_anonymous_is_rejected(task):
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", AnonymousUser())
    assert await refused_with(comm) == consumers.CLOSE_UNAUTHENTICATED
    comm = await communicator("/ws/tasks/", AnonymousUser())
    assert await refused_with(comm) == consumers.CLOSE_UNAUTHENTICATED


async def test_unknown_task_is_rejected(user):
    comm = await communicator("/ws/tasks/999999/?after=0", user)
    assert await refused_with(comm) == consumers.CLOSE_NOT_FOUND


async def test_a_resume_of_long_entries_reads_them_a_bounded_size_at_a_time(
    task, user, monkeypatch
):
    """A resume read 500 rows at once whatever their size (an entry's JSON goes up to
    WATCH_MAX_EVENT_BYTES: 500 rows of 2 MB, 1 GB in one read). Reads are bounded in
    characters too (one row at least), and every row still arrives, in order."""
    from tasks_app import consumers

    monkeypatch.setattr(consumers, "BATCH_CHARS", 150_000)
    await database_sync_to_async(record)(
        task.pk, {"task": {"id": "t-1", "status": {"state": "TASK_STATE_SUBMITTED"}}}, "stream"
    )
    for i in range(2, 9):
        long = {"statusUpdate": {**status(i)["statusUpdate"], "metadata": {"m": "x" * 100_000}}}
        await database_sync_to_async(record)(task.pk, long, "stream")
    reads: list[int] = []
    real = consumers._read_log

    async def counted(*args):
        rows, more = await real(*args)
        reads.append(len(rows))
        return rows, more

    monkeypatch.setattr(consumers, "_read_log", counted)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    connected, _ = await comm.connect()
    assert connected
    assert [m["seq"] for m in await collect(comm, 8)] == list(range(1, 9))
    assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 8}
    assert max(reads) <= 2 and sum(reads) == 8, reads  # a small row and a long one at most
    await comm.disconnect()


async def test_an_entry_too_long_to_send_live_goes_without_its_json(task, user):
    """An agent's event goes up to WATCH_MAX_EVENT_BYTES, and every open page of the task got
    it whole, into its DOM. Over SOCKET_RAW_CHARS a row goes without its JSON (its size
    said), on resume and live alike; the page links to it and redraws from the server."""
    from tasks_app import consumers

    await database_sync_to_async(record)(
        task.pk, {"task": {"id": "t-1", "status": {"state": "TASK_STATE_SUBMITTED"}}}, "stream"
    )
    long = {"statusUpdate": {**status(2)["statusUpdate"], "metadata": {"m": "x" * 100_000}}}
    await database_sync_to_async(record)(task.pk, long, "stream")
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    connected, _ = await comm.connect()
    assert connected
    small, big = await collect(comm, 2)
    assert small["raw"]["task"]["id"] == "t-1" and "raw_cut" not in small
    assert big["raw"] is None and consumers.SOCKET_RAW_CHARS < big["raw_cut"] < 110_000
    assert big["kind"] == "statusUpdate" and big["seq"] == 2
    assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 2}
    live = {"statusUpdate": {**status(3)["statusUpdate"], "metadata": {"m": "y" * 100_000}}}
    await database_sync_to_async(record)(task.pk, live, "stream")
    (arrived,) = await collect(comm, 1)
    assert arrived["seq"] == 3 and arrived["raw"] is None and arrived["raw_cut"] > 100_000
    await comm.disconnect()


async def test_a_query_that_is_not_utf8_resumes_from_the_start(task, user):
    """A raw client's query bytes that are not UTF-8 (browsers percent-encode) raised in the
    consumer after the accept; a malformed ``after`` means everything (nothing is lost)."""
    await database_sync_to_async(record)(
        task.pk, {"task": {"id": "t-1", "status": {"state": "TASK_STATE_SUBMITTED"}}}, "stream"
    )
    comm = await communicator(f"/ws/tasks/{task.pk}/", user)
    comm.scope["query_string"] = b"after=\xff\xfe"
    connected, _ = await comm.connect()
    assert connected
    assert [m["seq"] for m in await collect(comm, 1)] == [1]
    assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 1}
    await comm.disconnect()


async def test_resume_from_query_then_live(task, user):
    await database_sync_to_async(record)(
        task.pk, {"task": {"id": "t-1", "status": {"state": "TASK_STATE_SUBMITTED"}}}, "stream"
    )
    for i in range(1, 5):
        await database_sync_to_async(write)(task.pk, i)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=2", user)
    connected, _ = await comm.connect()
    assert connected
    backlog = await collect(comm, 5)
    assert [m["seq"] for m in backlog] == [3, 4, 5]
    assert backlog[0]["raw"]["statusUpdate"]["status"]["message"]["parts"] == [{"text": "step 2"}]
    synced = await comm.receive_json_from(timeout=5)
    assert synced == {"type": "synced", "last_seq": 5}
    for i in range(5, 8):
        await database_sync_to_async(write)(task.pk, i)
    live = await collect(comm, 8)
    assert [m["seq"] for m in live] == [6, 7, 8]
    assert live[-1]["state"] == "TASK_STATE_WORKING" and live[-1]["kind"] == "statusUpdate"
    await comm.disconnect()


async def test_resume_message_and_nothing_before_it(task, user):
    comm = await communicator(f"/ws/tasks/{task.pk}/", user)
    assert (await comm.connect())[0]
    await database_sync_to_async(write)(task.pk, 1)
    await database_sync_to_async(write)(task.pk, 2)
    assert await comm.receive_nothing(timeout=0.5)
    await comm.send_json_to({"type": "resume", "after": 0})
    got = await collect(comm, 2)
    assert [m["seq"] for m in got] == [1, 2]
    await comm.disconnect()


async def test_gap_is_filled_from_the_log_and_duplicates_dropped(task, user):
    for i in range(1, 4):
        await database_sync_to_async(write)(task.pk, i)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    assert [m["seq"] for m in await collect(comm, 3)] == [1, 2, 3]

    @database_sync_to_async
    def rows_without_relay() -> None:
        # Rows 4..7 reach the log, but their relay is "lost" (e.g. a Redis hiccup).
        for seq in range(4, 8):
            TaskEvent.objects.create(
                task_id=task.pk, seq=seq, channel="poll", kind="system",
                raw={"system": {"n": seq}}, state_after="TASK_STATE_WORKING",
            )  # fmt: skip
        RemoteTask.objects.filter(pk=task.pk).update(last_seq=7)

    await rows_without_relay()
    layer = get_channel_layer()
    group = task_group(task.pk)
    base = {
        "type": "task.event",
        "task": task.pk,
        "kind": "system",
        "channel": "poll",
        "state": "",
        "note": "",
        "received_at": "",
    }
    # seq 6 arrives first (4 and 5 were never relayed): the consumer reads 4..6 from the log.
    await layer.group_send(group, {**base, "seq": 6, "raw_json": '{"system":{"n":6}}'})
    # A duplicate of 5, then 7 without its raw JSON (too large to relay): read from the log.
    await layer.group_send(group, {**base, "seq": 5, "raw_json": '{"system":{"n":5}}'})
    await layer.group_send(group, {**base, "seq": 7})
    got = await collect(comm, 7)
    assert [m["seq"] for m in got] == [4, 5, 6, 7]
    assert [m["raw"] for m in got] == [{"system": {"n": n}} for n in range(4, 8)]
    assert await comm.receive_nothing(timeout=0.3)
    await comm.disconnect()


async def test_connect_while_a_writer_appends_gives_every_seq_once(task, user):
    """The race the protocol exists for: join, read the log, forward live, all while
    another thread appends. Whatever the interleaving: 1..N once each, in order."""
    total = 60
    started = threading.Event()

    def writer() -> None:
        try:
            for i in range(1, total + 1):
                write(task.pk, i)
                if i == 10:
                    started.set()
                time.sleep(0.01)
        finally:
            close_old_connections()

    thread = threading.Thread(target=writer)
    thread.start()
    await sync_to_async(started.wait)(10)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    got = await collect(comm, total, timeout=30)
    await sync_to_async(thread.join)(10)
    assert [m["seq"] for m in got] == list(range(1, total + 1))
    # A second browser that had seen 25 resumes with exactly the rest.
    again = await communicator(f"/ws/tasks/{task.pk}/?after=25", user)
    assert (await again.connect())[0]
    assert [m["seq"] for m in await collect(again, total)] == list(range(26, total + 1))
    await comm.disconnect()
    await again.disconnect()


async def forget_group(group: str) -> None:
    """What a Redis restart, or channels_redis's group expiry, does to a group: its
    membership is gone, and the sockets in it hear nothing more from it."""
    import redis

    layer = get_channel_layer()
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        await sync_to_async(client.delete)(layer._group_key(group))
    finally:
        client.close()


async def socket_after_two_rows(task, user) -> WebsocketCommunicator:
    """A task socket that has read the task's two rows from the log and is synced."""
    for i in range(1, 3):
        await database_sync_to_async(write)(task.pk, i)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    assert [m["seq"] for m in await collect(comm, 2)] == [1, 2]
    assert (await comm.receive_json_from(timeout=5)) == {"type": "synced", "last_seq": 2}
    return comm


async def test_a_task_socket_that_lost_its_group_is_live_again_after_its_next_sync(task, user):
    comm = await socket_after_two_rows(task, user)
    await forget_group(task_group(task.pk))
    await database_sync_to_async(write)(task.pk, 3)
    assert await comm.receive_nothing(timeout=0.5)  # relayed to a group it is no longer in
    await comm.send_json_to({"type": "sync", "after": 2})  # the browser, silent for a while
    events, synced = await until_type(comm, "synced")
    assert [m["seq"] for m in events] == [3] and synced["last_seq"] == 3
    # Joined again: the next row comes live, with no sync asked.
    await database_sync_to_async(write)(task.pk, 4)
    assert [m["seq"] for m in await collect(comm, 4, timeout=5)] == [4]
    await comm.disconnect()


async def test_a_list_socket_that_lost_its_group_is_live_again_after_its_next_sync(task, user):
    from tasks_app.relay import LIST_GROUP

    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    await forget_group(LIST_GROUP)
    await database_sync_to_async(write)(task.pk, 1)
    assert await comm.receive_nothing(timeout=0.5)
    await comm.send_json_to({"type": "sync", "since": "2000-01-01T00:00:00+00:00"})
    repaired, version = await until_type(comm, "version")
    assert [(m["task"], m["last_seq"], m.get("resync")) for m in repaired] == [(task.pk, 1, True)]
    assert version["version"] == repaired[0]["updated_at"]
    await database_sync_to_async(write)(task.pk, 2)
    live = await comm.receive_json_from(timeout=5)
    assert (live["type"], live["task"], live["last_seq"]) == ("task", task.pk, 2)
    assert "resync" not in live
    await comm.disconnect()


async def test_list_consumer_forwards_summaries(task, user):
    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    await database_sync_to_async(record)(
        task.pk,
        {"task": {"id": "t-9", "contextId": "c-9", "status": {"state": "TASK_STATE_WORKING"}}},
        "poll",
    )
    msg = await comm.receive_json_from(timeout=5)
    assert msg["type"] == "task" and msg["task"] == task.pk
    assert (
        msg["state"] == "TASK_STATE_WORKING" and msg["remote_id"] == "t-9" and msg["last_seq"] == 1
    )
    await comm.disconnect()


async def test_list_consumer_forwards_each_summary_of_a_batch_it_may_read(task, user):
    """Summaries relayed together (``relay.summarize``) reach a list page one by one, in
    order, and a task of an agent the person may not read is left out of the batch."""
    from tasks_app.models import Project
    from tasks_app.relay import LIST_GROUP, summarize

    @database_sync_to_async
    def other_task() -> RemoteTask:
        hidden = Project.objects.create(name="hidden")
        agent = Agent.objects.create(name="b", base_url="http://127.0.0.1:2/", project=hidden)
        return RemoteTask.objects.create(agent=agent, title="not yours")

    hidden = await other_task()
    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    summaries = {
        pk: {"type": "tasks.changed", "task": pk, "agent": agent, "last_seq": seq}
        for pk, agent, seq in [
            (task.pk, task.agent_id, 3),
            (hidden.pk, hidden.agent_id, 5),
            (task.pk + 1000, task.agent_id, 7),
        ]
    }
    (message,) = summarize(summaries)
    assert message["type"] == "tasks.summaries" and len(message["summaries"]) == 3
    await get_channel_layer().group_send(LIST_GROUP, message)
    got = [await comm.receive_json_from(timeout=5) for _ in range(2)]
    assert [(m["type"], m["task"], m["last_seq"]) for m in got] == [
        ("task", task.pk, 3),
        ("task", task.pk + 1000, 7),
    ]
    assert await comm.receive_nothing(timeout=0.5)
    await comm.disconnect()


def test_summaries_of_a_batch_go_in_few_messages_of_bounded_size():
    from tasks_app.relay import SUMMARIES_PER_MESSAGE, summarize

    one = {7: {"type": "tasks.changed", "task": 7}}
    assert summarize(one) == [one[7]]  # alone, as it always was
    many = {pk: {"type": "tasks.changed", "task": pk} for pk in range(450)}
    messages = summarize(many)
    assert [len(m["summaries"]) for m in messages] == [SUMMARIES_PER_MESSAGE, 200, 50]
    assert [s["task"] for m in messages for s in m["summaries"]] == list(range(450))


def test_settings_use_redis_layer():
    assert settings.CHANNEL_LAYERS["default"]["BACKEND"].startswith("channels_redis")


async def test_ping(task, user):
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    await comm.send_json_to({"type": "ping"})
    msg = await comm.receive_json_from(timeout=5)
    while msg["type"] != "pong":
        msg = await comm.receive_json_from(timeout=5)
    await comm.disconnect()
    await asyncio.sleep(0)


def test_relay_packs_runs_of_events_and_keeps_the_order():
    from tasks_app.relay import pack

    events = [{"type": "task.event", "seq": n} for n in (1, 2, 3)]
    watcher = {"type": "task.watcher"}
    packed = pack([*events[:2], watcher, events[2]])
    assert packed == [{"type": "task.events", "events": events[:2]}, watcher, events[2]]
    assert pack([]) == []


async def test_a_batch_recorded_at_once_arrives_event_by_event(task, user):
    from tasks_app.services.record import record_many

    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    assert (await comm.receive_json_from(timeout=5))["type"] == "synced"
    await database_sync_to_async(record_many)(task.pk, [status(i) for i in range(1, 6)], "stream")
    got = await collect(comm, 5)
    assert [m["seq"] for m in got] == [1, 2, 3, 4, 5]
    assert got[2]["raw"]["statusUpdate"]["status"]["message"]["parts"] == [{"text": "step 3"}]
    await comm.disconnect()


async def test_a_relayed_rows_json_text_reaches_the_browser_as_the_value_stored(task, user):
    """The relay carries an entry kept as it came as its canonical text (``raw_json``), and
    the socket splices that text into the frame: what the browser parses is the value the
    log stores, quotes, backslashes, non-ASCII, line separators and numbers included."""
    from tasks_app.services import record as record_module

    awkward = {"statusUpdate": {"taskId": "t", "contextId": "c", "status": {
        "state": "TASK_STATE_WORKING", "message": {"messageId": "m-awk", "role": "ROLE_AGENT",
            "parts": [{"text": 'say "hi" \\ é 漢 \u2028 </script> \U0001f600'}]}},
        "metadata": {"n": 1.5e300, "small": 1e-07, "neg": -3, "list": [True, None, "x"]}}}  # fmt: skip
    relayed: list = []
    real = record_module.relay.publish

    def keep(messages):
        relayed.extend(messages)
        real(messages)

    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    assert (await comm.receive_json_from(timeout=5))["type"] == "synced"
    record_module.relay.publish = keep
    try:
        await database_sync_to_async(record)(task.pk, awkward, "stream")
    finally:
        record_module.relay.publish = real
    [row] = await collect(comm, 1)
    stored = await database_sync_to_async(lambda: TaskEvent.objects.get(task=task, seq=1).raw)()
    assert row["raw"] == stored
    assert stored["statusUpdate"]["metadata"]["n"] == int(1.5e300)  # cleaned: as jsonb reads it
    [message] = [m for group, m in relayed if group == task_group(task.pk)]
    assert "raw" not in message and json.loads(message["raw_json"]) == stored
    await comm.disconnect()


# Re-sync: a relay message that never arrives ------------------------------------------------


def record_with_relay_lost(task_pk: int, obj: dict, channel: str = "poll") -> None:
    """Append through record() while relay.publish drops everything: the row reaches the
    log and the mirror, no group ever hears of it (a lost relay message)."""
    from unittest import mock

    with mock.patch("tasks_app.relay.publish", lambda messages: None):
        record(task_pk, obj, channel)


async def until_type(
    comm: WebsocketCommunicator, kind: str, timeout: float = 10
) -> tuple[list[dict], dict]:
    """Messages until one of type ``kind`` (returned apart from the others)."""
    before: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no {kind!r}; got {before}"
        msg = await comm.receive_json_from(timeout=remaining)
        if msg["type"] == kind:
            return before, msg
        before.append(msg)


async def test_idle_sync_delivers_a_last_event_whose_relay_was_lost(task, user):
    comm = await socket_after_two_rows(task, user)
    # An idle sync with nothing new: just "synced", no rows.
    await comm.send_json_to({"type": "sync", "after": 2})
    assert (await comm.receive_json_from(timeout=5)) == {"type": "synced", "last_seq": 2}

    await database_sync_to_async(record_with_relay_lost)(task.pk, status(3, "TASK_STATE_COMPLETED"))
    assert await comm.receive_nothing(timeout=0.5)  # lost indeed: nothing relayed
    await comm.send_json_to({"type": "sync", "after": 2})
    events, synced = await until_type(comm, "synced")
    assert [(m["type"], m["seq"], m["state"]) for m in events] == [
        ("event", 3, "TASK_STATE_COMPLETED")
    ]
    assert events[0]["raw"]["statusUpdate"]["status"]["message"]["parts"] == [{"text": "step 3"}]
    assert synced == {"type": "synced", "last_seq": 3}
    # Asking again (or with a seq the browser has not caught up to) never repeats a row.
    await comm.send_json_to({"type": "sync", "after": 1})
    assert (await comm.receive_json_from(timeout=5)) == {"type": "synced", "last_seq": 3}
    await comm.disconnect()


async def test_sync_before_any_resume_resumes_and_bad_input_is_harmless(task, user):
    await database_sync_to_async(write)(task.pk, 1)
    comm = await communicator(f"/ws/tasks/{task.pk}/", user)
    assert (await comm.connect())[0]
    for junk in ([1, 2], "sync", {"type": "sync", "after": "x"}):
        await comm.send_json_to(junk)
    events, synced = await until_type(comm, "synced")  # the malformed sync resumed from 0
    assert [m["seq"] for m in events] == [1] and synced["last_seq"] == 1
    await comm.send_json_to({"type": "sync", "after": None})
    assert (await comm.receive_json_from(timeout=5)) == {"type": "synced", "last_seq": 1}
    await comm.disconnect()


async def test_list_sync_by_version_repairs_a_lost_summary(task, user):
    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    # No version yet: the answer is only the current one.
    await comm.send_json_to({"type": "sync", "since": None})
    assert await until_type(comm, "version") == (
        [],
        {"type": "version", "version": task.updated_at.isoformat()},
    )
    await database_sync_to_async(record)(task.pk, status(1), "poll")
    live = await comm.receive_json_from(timeout=5)
    assert live["type"] == "task" and live["last_seq"] == 1 and "resync" not in live
    version = live["updated_at"]

    other = await database_sync_to_async(RemoteTask.objects.create)(
        agent_id=task.agent_id, title="quiet"
    )
    await database_sync_to_async(record_with_relay_lost)(task.pk, status(2, "TASK_STATE_COMPLETED"))
    assert await comm.receive_nothing(timeout=0.5)  # the summary is lost
    await comm.send_json_to({"type": "sync", "since": version})
    rows, answer = await until_type(comm, "version")
    fresh = await database_sync_to_async(RemoteTask.objects.get)(pk=task.pk)
    by_task = {m["task"]: m for m in rows}
    assert by_task[task.pk]["state"] == "TASK_STATE_COMPLETED" and by_task[task.pk]["last_seq"] == 2
    assert by_task[task.pk]["resync"] is True and by_task[task.pk]["type"] == "task"
    assert other.pk in by_task  # created after the version: new rows are found too
    assert answer["version"] == max(fresh.updated_at, other.updated_at).isoformat()
    await comm.disconnect()


async def test_list_sync_is_one_query_and_bounded(task, user):
    from asgiref.sync import async_to_sync
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tasks_app.consumers import LIST_SYNC_LIMIT, TaskListConsumer

    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    # Malformed versions are answered with the current version, nothing else.
    for since in ("yesterday", 12, "2024-13-45T00:00:00", "x" * 500):
        await comm.send_json_to({"type": "sync", "since": since})
        rows, answer = await until_type(comm, "version")
        assert rows == [] and answer["version"] == task.updated_at.isoformat()
    # A version from the future is clamped to now: nothing changed since then.
    await comm.send_json_to({"type": "sync", "since": "2999-01-01T00:00:00+00:00"})
    rows, answer = await until_type(comm, "version")
    assert answer["version"] < "2999"
    assert [m["task"] for m in rows] == [task.pk]  # only what changed within the overlap
    await comm.disconnect()

    # However old the version, the answer is one query for at most LIST_SYNC_LIMIT rows.
    @database_sync_to_async
    def many() -> None:
        RemoteTask.objects.bulk_create(
            RemoteTask(agent_id=task.agent_id, title=f"t{i}") for i in range(LIST_SYNC_LIMIT + 5)
        )

    await many()
    sent: list[dict] = []
    consumer = TaskListConsumer()

    async def capture(content: dict, close: bool = False) -> None:
        sent.append(content)

    consumer.send_json = capture  # type: ignore[method-assign]

    @database_sync_to_async
    def counted(since: str | None) -> int:
        # The handler's database work runs on this very thread (thread-sensitive).
        with CaptureQueriesContext(connection) as queries:
            async_to_sync(consumer.receive_json)({"type": "sync", "since": since})
        return len(queries)

    assert await counted("2000-01-01T00:00:00Z") == 1
    assert len(sent) == LIST_SYNC_LIMIT + 1 and sent[-1]["type"] == "version"
    assert [m["resync"] for m in sent[:-1]] == [True] * LIST_SYNC_LIMIT
    sent.clear()
    assert await counted(None) == 1
    assert [m["type"] for m in sent] == ["version"]


async def test_task_sync_when_idle_is_one_query(task, user):
    from asgiref.sync import async_to_sync
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tasks_app.consumers import TaskConsumer

    await database_sync_to_async(write)(task.pk, 1)
    sent: list[dict] = []
    consumer = TaskConsumer()
    consumer.task_pk = task.pk
    consumer.last_sent = 1

    async def capture(content: dict, close: bool = False) -> None:
        sent.append(content)

    consumer.send_json = capture  # type: ignore[method-assign]

    @database_sync_to_async
    def counted() -> int:
        with CaptureQueriesContext(connection) as queries:
            async_to_sync(consumer.receive_json)({"type": "sync", "after": 1})
        return len(queries)

    assert await counted() == 1
    assert sent == [{"type": "synced", "last_seq": 1}]


async def test_open_sockets_follow_a_change_of_access_at_once(task, user):
    """A role taken away closes the person's task socket (as if the task did not exist) and
    stops the list's summaries of that project; given back, they flow again; a person made
    inactive is closed out. No reconnect is needed for any of it."""
    from django.contrib.auth import get_user_model

    from tasks_app.models import Membership
    from tasks_app.relay import LIST_GROUP

    summary = {"type": "tasks.changed", "task": task.pk, "agent": task.agent_id, "last_seq": 4}
    task_socket = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await task_socket.connect())[0]
    list_socket = await communicator("/ws/tasks/", user)
    assert (await list_socket.connect())[0]
    await get_channel_layer().group_send(LIST_GROUP, summary)
    assert (await list_socket.receive_json_from(timeout=5))["task"] == task.pk

    role = await database_sync_to_async(
        lambda: Membership.objects.filter(user=user).values_list("project_id", "role").get()
    )()
    await database_sync_to_async(lambda: Membership.objects.filter(user=user).delete())()
    closed = await task_socket.receive_output(timeout=5)
    while closed["type"] != "websocket.close":  # the resume's own messages come first
        closed = await task_socket.receive_output(timeout=5)
    assert closed["code"] == 4404
    await get_channel_layer().group_send(LIST_GROUP, summary)
    assert await list_socket.receive_nothing(timeout=1)

    await database_sync_to_async(
        lambda: Membership.objects.create(user=user, project_id=role[0], role=role[1])
    )()
    await asyncio.sleep(0.5)  # the news reaches the socket before the next summary
    await get_channel_layer().group_send(LIST_GROUP, summary)
    assert (await list_socket.receive_json_from(timeout=5))["task"] == task.pk

    def deactivate() -> None:
        person = get_user_model().objects.get(pk=user.pk)
        person.is_active = False
        person.save()

    await database_sync_to_async(deactivate)()
    closed = await list_socket.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": 4401}


async def test_a_lost_change_of_access_is_caught_at_the_next_sync_when_due(task, user, monkeypatch):
    """The news of a role taken away can be lost like any relay message (a Redis restart):
    a re-sync checks access afresh once ``ACCESS_RECHECK_SECONDS`` have passed, so the task
    socket closes as if the task did not exist and the list answers nothing of that
    project. (Due at once here; the idle-sync tests above hold the other case: not due,
    one query.)"""
    from unittest import mock

    from tasks_app import consumers
    from tasks_app.models import Membership
    from tasks_app.relay import LIST_GROUP

    monkeypatch.setattr(consumers, "ACCESS_RECHECK_SECONDS", 0.0)

    await database_sync_to_async(write)(task.pk, 1)
    task_socket = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await task_socket.connect())[0]
    await until_type(task_socket, "synced")
    list_socket = await communicator("/ws/tasks/", user)
    assert (await list_socket.connect())[0]

    def take_the_role_silently() -> None:
        with mock.patch("tasks_app.relay.publish", lambda messages: None):
            Membership.objects.filter(user=user).delete()

    await database_sync_to_async(take_the_role_silently)()
    assert await task_socket.receive_nothing(timeout=0.5)  # the news is lost: still open
    await task_socket.send_json_to({"type": "sync", "after": 1})
    assert await task_socket.receive_output(timeout=5) == {"type": "websocket.close", "code": 4404}

    await list_socket.send_json_to({"type": "sync", "since": "2000-01-01T00:00:00+00:00"})
    answered = await list_socket.receive_json_from(timeout=5)
    assert answered["type"] == "version"  # no summary of the task it may no longer read
    summary = {"type": "tasks.changed", "task": task.pk, "agent": task.agent_id, "last_seq": 2}
    await get_channel_layer().group_send(LIST_GROUP, summary)
    assert await list_socket.receive_nothing(timeout=0.5)
    await list_socket.disconnect()


async def test_a_login_alone_tells_no_socket(task, user):
    """Saving only ``last_login`` (every login does) changes nothing anyone may read."""
    from django.contrib.auth.models import update_last_login

    list_socket = await communicator("/ws/tasks/", user)
    assert (await list_socket.connect())[0]
    await database_sync_to_async(lambda: update_last_login(None, user))()
    assert await list_socket.receive_nothing(timeout=1)
    await list_socket.disconnect()


async def test_an_agent_moved_to_another_project_closes_its_tasks_to_the_old_members(task, user):
    from tasks_app.models import Project

    task_socket = await communicator(f"/ws/tasks/{task.pk}/", user)
    assert (await task_socket.connect())[0]

    def move() -> None:
        agent = Agent.objects.get(pk=task.agent_id)
        agent.project = Project.objects.create(name="elsewhere")
        agent.save()

    await database_sync_to_async(move)()
    closed = await task_socket.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": 4404}


async def test_a_membership_moved_to_another_person_closes_the_first_persons_sockets(task, user):
    """The admin can give a membership row another person: the role is taken from the first,
    whose sockets were not told and streamed on until their periodic recheck (a minute)."""
    from django.contrib.auth.models import User

    task_socket = await communicator(f"/ws/tasks/{task.pk}/", user)
    assert (await task_socket.connect())[0]

    def move() -> None:
        membership = Membership.objects.get(user=user)
        membership.user = User.objects.create_user("someone-else")
        membership.save()

    await database_sync_to_async(move)()
    closed = await task_socket.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": 4404}


# Malformed frames from a browser: dropped, the socket stays open and keeps working ----------

# Frames that are not a JSON object: channels' JSON consumer raised on each (daphne logged
# "Exception inside application" and closed the socket with 1011).
NOT_AN_OBJECT = [
    "not json",
    "",
    "{",
    "[1, 2]",
    "5",
    '"sync"',
    "null",
    "[" * 100_000,  # nested too deep for json (RecursionError)
    '{"type": "resume", "after": ' + "9" * 5000 + "}",  # more digits than int() reads
]
# Seq values Python's json accepts that are no seq the log can hold: a resume (or a first
# sync) with one of them starts from the beginning, as a missing one does.
BAD_SEQS = [
    "1e400",
    "-1e400",
    "Infinity",
    "-Infinity",
    "NaN",
    "true",
    "[3]",
    '{"n": 1}',
    '"abc"',
    '"1e400"',
    str(2**31),
    "9" * 30,
]


def no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []


async def send_junk(comm: WebsocketCommunicator) -> None:
    """Every kind of malformed frame; each is dropped without an answer."""
    # As daphne hands frames over (send_to refuses an empty one).
    for text in NOT_AN_OBJECT:
        await comm.send_input({"type": "websocket.receive", "text": text})
    for data in (b'{"type": "sync"}', b""):
        await comm.send_input({"type": "websocket.receive", "bytes": data})
    for seq in BAD_SEQS:
        await comm.send_to(text_data=f'{{"type": {seq}, "after": 0}}')  # a type of no kind
    assert await comm.receive_nothing(timeout=0.3)


async def test_malformed_frames_leave_a_task_socket_open_and_working(task, user, caplog):
    for i in range(1, 3):
        await database_sync_to_async(write)(task.pk, i)
    comm = await communicator(f"/ws/tasks/{task.pk}/", user)
    assert (await comm.connect())[0]
    await send_junk(comm)  # before any resume: nothing is sent, nothing breaks
    await comm.send_json_to({"type": "resume", "after": 1})
    events, synced = await until_type(comm, "synced")
    assert [m["seq"] for m in events] == [2] and synced == {"type": "synced", "last_seq": 2}
    await send_junk(comm)  # and after it
    await comm.send_json_to({"type": "sync", "after": 2})
    assert (await comm.receive_json_from(timeout=5)) == {"type": "synced", "last_seq": 2}
    await comm.send_json_to({"type": "ping"})
    assert (await comm.receive_json_from(timeout=5)) == {"type": "pong"}
    await comm.disconnect()
    no_errors_logged(caplog)


async def test_a_seq_that_is_no_seq_resumes_from_the_start(task, user, caplog):
    """``1e400`` or ``Infinity`` made ``int()`` raise OverflowError, ``NaN`` ValueError; a
    seq past the column's range is no seq either. Each resumes from the start (nothing lost)."""
    for i in range(1, 3):
        await database_sync_to_async(write)(task.pk, i)
    for seq in (*BAD_SEQS, '"1_1"', '"\u0661"', '" 2 "'):  # only ASCII digits are a seq
        comm = await communicator(f"/ws/tasks/{task.pk}/", user)
        assert (await comm.connect())[0]
        await comm.send_to(text_data=f'{{"type": "resume", "after": {seq}}}')
        events, synced = await until_type(comm, "synced")
        expected = [] if seq == '" 2 "' else [1, 2]
        assert ([m["seq"] for m in events], synced["last_seq"]) == (expected, 2), seq
        await comm.disconnect()
    comm = await communicator(f"/ws/tasks/{task.pk}/", user)
    assert (await comm.connect())[0]
    await comm.send_json_to({"type": "resume", "after": 1})  # a good one still answers as ever
    events, synced = await until_type(comm, "synced")
    assert [m["seq"] for m in events] == [2] and synced["last_seq"] == 2
    await comm.disconnect()

    # A first sync (before any resume) with one of them, and the same in the query string.
    for seq in BAD_SEQS:
        comm = await communicator(f"/ws/tasks/{task.pk}/", user)
        assert (await comm.connect())[0]
        await comm.send_to(text_data=f'{{"type": "sync", "after": {seq}}}')
        events, synced = await until_type(comm, "synced")
        assert ([m["seq"] for m in events], synced["last_seq"]) == ([1, 2], 2), seq
        await comm.send_json_to({"type": "sync", "after": 2})
        assert (await comm.receive_json_from(timeout=5)) == {"type": "synced", "last_seq": 2}
        await comm.disconnect()
    for query in ("1e400", "inf", "nan", "-3", "9" * 30, "x"):
        comm = await communicator(f"/ws/tasks/{task.pk}/?after={query}", user)
        assert (await comm.connect())[0]
        events, synced = await until_type(comm, "synced")
        assert ([m["seq"] for m in events], synced["last_seq"]) == ([1, 2], 2), query
        await comm.disconnect()
    no_errors_logged(caplog)


async def test_a_list_socket_answers_a_since_at_the_edges_of_time(task, user, caplog):
    """``since - LIST_OVERLAP`` overflowed for a ``since`` near year 1, and so did converting
    one with an offset to UTC near either end of datetime's range. An early one asks for
    everything, a future one for now; malformed frames are dropped."""
    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    await send_junk(comm)
    for since in (
        "0001-01-01",
        "0001-01-01T00:00:00",
        "0001-01-01T00:00:00+05:00",
        "0001-01-01T00:00:00-23:59",
        "1969-12-31T23:59:59Z",
    ):
        await comm.send_json_to({"type": "sync", "since": since})
        rows, answer = await until_type(comm, "version")
        assert [m["task"] for m in rows] == [task.pk], since
        assert answer["version"] == task.updated_at.isoformat(), since
    for since in (
        "9999-12-31T23:59:59.999999",
        "9999-12-31T23:59:59.999999-23:59",
        "9999-12-31T23:59:59+05:00",
    ):
        await comm.send_json_to({"type": "sync", "since": since})
        rows, answer = await until_type(comm, "version")
        assert [m["task"] for m in rows] == [task.pk], since  # changed within the overlap
        assert task.updated_at.isoformat() <= answer["version"] < "9999", since
    await send_junk(comm)
    await comm.send_json_to({"type": "sync", "since": task.updated_at.isoformat()})
    rows, answer = await until_type(comm, "version")
    assert [m["task"] for m in rows] == [task.pk]
    assert answer["version"] == task.updated_at.isoformat()
    await comm.disconnect()
    no_errors_logged(caplog)


def test_daphne_keeps_a_socket_open_through_malformed_frames(task, user, start_daphne, client):
    """The same through a real daphne: no "Exception inside application", no 1011 close."""
    from websockets.sync.client import connect as ws_connect

    client.force_login(user)
    record(task.pk, status(1), "stream")
    server = start_daphne()
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    url = server.url.replace("http://", "ws://")
    with ws_connect(
        f"{url}/ws/tasks/{task.pk}/",
        origin=server.url,
        additional_headers={"Cookie": cookie},
        open_timeout=10,
    ) as ws:
        for text in NOT_AN_OBJECT:
            ws.send(text)
        ws.send(b'{"type": "resume", "after": 0}')
        ws.send('{"type": "resume", "after": 1e400}')
        first, synced = json.loads(ws.recv(timeout=10)), json.loads(ws.recv(timeout=10))
        assert (first["type"], first["seq"]) == ("event", 1)
        assert synced == {"type": "synced", "last_seq": 1}
        ws.send('{"type": "sync", "after": NaN}')
        assert json.loads(ws.recv(timeout=10)) == {"type": "synced", "last_seq": 1}
    with ws_connect(
        f"{url}/ws/tasks/",
        origin=server.url,
        additional_headers={"Cookie": cookie},
        open_timeout=10,
    ) as ws:
        ws.send("[]")
        ws.send(b"\x00")
        ws.send('{"type": "sync", "since": "0001-01-01T00:00:00+05:00"}')
        assert json.loads(ws.recv(timeout=10))["task"] == task.pk
        assert json.loads(ws.recv(timeout=10))["type"] == "version"
    log = server.log_tail(400)
    assert "Exception inside application" not in log and "Traceback" not in log, log


# -- what one socket may make the server do (found by crafted frames) ------------------------


def write_many(task_pk: int, first: int, last: int) -> None:
    from tasks_app.services.record import record_many

    for start in range(first, last + 1, 100):
        record_many(
            task_pk, [status(i) for i in range(start, min(start + 100, last + 1))], "stream"
        )


async def test_a_socket_resumes_once_and_a_later_resume_sends_only_what_is_new(task, user):
    """A resume frame is a few bytes and made the whole log be sent again: twenty of them
    on a log of 3,000 rows sent 60,000 messages. A later resume is now a sync."""
    await database_sync_to_async(write_many)(task.pk, 1, 600)  # more than one read's BATCH
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    events, synced = await until_type(comm, "synced", timeout=30)
    assert [m["seq"] for m in events] == list(range(1, 601)) and synced["last_seq"] == 600
    for _ in range(20):
        await comm.send_json_to({"type": "resume", "after": 0})
    for _ in range(20):
        assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 600}
    assert await comm.receive_nothing(timeout=0.3)
    await database_sync_to_async(record_with_relay_lost)(task.pk, status(601))
    await comm.send_json_to({"type": "resume", "after": 0})
    events, synced = await until_type(comm, "synced")
    assert [m["seq"] for m in events] == [601] and synced["last_seq"] == 601
    await comm.disconnect()


async def test_a_resume_past_the_end_of_the_log_counts_from_its_end(task, user):
    """A stale page (or a task number used again) asking after seq 11 of a 2-row log was
    told "synced 11", and rows 3 to 11 were then dropped as already sent."""
    await database_sync_to_async(write_many)(task.pk, 1, 2)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=11", user)
    assert (await comm.connect())[0]
    assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 2}
    await database_sync_to_async(write)(task.pk, 3)
    events = await collect(comm, 3)
    assert [m["seq"] for m in events] == [3]
    await comm.disconnect()


async def test_a_lost_change_of_access_is_caught_before_anything_more_is_sent(
    task, user, monkeypatch
):
    """A socket that never asks for a re-sync (only resumes, or only listens) was never
    checked again: access is now checked, when due, before any frame is answered and before
    any live row or summary goes out."""
    from unittest import mock

    from tasks_app import consumers
    from tasks_app.models import Membership
    from tasks_app.relay import LIST_GROUP

    await database_sync_to_async(write)(task.pk, 1)
    resuming = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    listening = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    list_socket = await communicator("/ws/tasks/", user)
    for socket in (resuming, listening):
        assert (await socket.connect())[0]
        await until_type(socket, "synced")
    assert (await list_socket.connect())[0]

    def take_the_role_silently() -> None:
        with mock.patch("tasks_app.relay.publish", lambda messages: None):
            Membership.objects.filter(user=user).delete()

    await database_sync_to_async(take_the_role_silently)()
    monkeypatch.setattr(consumers, "ACCESS_RECHECK_SECONDS", 0.0)
    await resuming.send_json_to({"type": "resume", "after": 0})
    assert await resuming.receive_output(timeout=5) == {"type": "websocket.close", "code": 4404}
    await database_sync_to_async(write)(task.pk, 2)  # relayed live to the listening socket
    assert await listening.receive_output(timeout=5) == {"type": "websocket.close", "code": 4404}
    summary = {"type": "tasks.changed", "task": task.pk, "agent": task.agent_id, "last_seq": 2}
    await get_channel_layer().group_send(LIST_GROUP, summary)
    assert await list_socket.receive_nothing(timeout=0.5)
    await list_socket.disconnect()


async def test_a_deleted_person_is_closed_out_even_with_no_membership(task, django_user_model):
    """A superuser has no memberships, whose deletion told the sockets of anyone else."""
    boss = await database_sync_to_async(
        lambda: django_user_model.objects.create_superuser(username="boss", password="pw-1234567")
    )()
    task_socket = await communicator(f"/ws/tasks/{task.pk}/?after=0", boss)
    list_socket = await communicator("/ws/tasks/", boss)
    assert (await task_socket.connect())[0] and (await list_socket.connect())[0]
    await until_type(task_socket, "synced")
    await database_sync_to_async(lambda: django_user_model.objects.filter(pk=boss.pk).delete())()
    for socket in (task_socket, list_socket):
        assert await socket.receive_output(timeout=5) == {"type": "websocket.close", "code": 4401}


@pytest.mark.parametrize("path", ["/ws/tasks/abc/", "/ws/tasks/1", "/ws/tasks/-1/", "/ws/x/", "/"])
async def test_a_socket_path_that_is_no_route_is_refused_without_an_error(path, user, caplog):
    """No route used to raise ValueError, which daphne logs as an error with a traceback."""
    comm = await communicator(path, user)
    assert await refused_with(comm) == 4404
    no_errors_logged(caplog)


def leaving_after(sends: int):
    """The websocket app with a send that fails as daphne's does once the browser has left
    (autobahn's Disconnected, "Attempt to send on a closed protocol") after ``sends`` frames.
    daphne drops most such sends itself; this is the window in which it does not."""
    from autobahn.exception import Disconnected

    async def application(scope, receive, send):
        count = 0

        async def send_until_gone(message):
            nonlocal count
            if message["type"] == "websocket.send":
                count += 1
                if count > sends:
                    raise Disconnected("Attempt to send on a closed protocol")
            await send(message)

        return await app(scope, receive, send_until_gone)

    return application


async def test_a_browser_that_leaves_during_a_long_resume_ends_the_socket_cleanly(task, user):
    """The tab closed while its resume was sending 1,500 rows: the failed send ended the
    consumer with "Exception inside application", and its groups kept the dead channel for
    a day (channels skips ``disconnect`` then). Now the sends stop and the groups are left."""
    import redis

    await database_sync_to_async(write_many)(task.pk, 1, 1500)  # within RESUME_MAX_ROWS
    layer = get_channel_layer()
    members = redis.Redis.from_url(settings.REDIS_URL)
    key = f"{layer.prefix}:group:{task_group(task.pk)}"
    comm = WebsocketCommunicator(leaving_after(5), f"/ws/tasks/{task.pk}/?after=0")
    await sync_to_async(signed_in)(comm.scope, user)
    assert (await comm.connect())[0]
    assert [(await comm.receive_json_from(timeout=5))["seq"] for _ in range(5)] == [1, 2, 3, 4, 5]
    assert members.zcard(key) == 1
    assert await comm.receive_nothing(timeout=0.5)  # nothing more is sent, nothing raised
    await comm.disconnect()  # re-raises what the application raised
    assert members.zcard(key) == 0


async def test_a_resume_too_far_behind_tells_the_page_to_load_again(task, user, monkeypatch):
    """``?after=0`` of a long log queued the whole log in the server for a browser that need
    not read it; a page that far behind loads again (the newest rows) instead."""
    from tasks_app import consumers

    monkeypatch.setattr(consumers, "RESUME_MAX_ROWS", 3)
    for i in range(1, 6):
        await database_sync_to_async(write)(task.pk, i)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=1", user)
    assert (await comm.connect())[0]
    assert (await comm.receive_json_from(timeout=5)) == {"type": "reload", "last_seq": 5}
    await database_sync_to_async(write)(task.pk, 6)
    assert await comm.receive_nothing(timeout=0.5)  # not resumed: nothing live either
    # Within reach (the page loaded again), the same socket resumes as any.
    await comm.send_json_to({"type": "resume", "after": 3})
    events, synced = await until_type(comm, "synced")
    assert [m["seq"] for m in events] == [4, 5, 6] and synced["last_seq"] == 6
    await comm.disconnect()
