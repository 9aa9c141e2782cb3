"""The live view's promises where they broke: access changed inside a socket's connect or
its long resume, a list re-sync cut at its limit, a Redis that answers nothing, a hole in
the log as the task page meets it.

Real Redis channel layer (a private prefix: ``tests.test_consumers``), real ``record()``;
what is injected is a change at one point (an access taken away right after a check, or
inside a resume) and a Redis stand-in that takes connections and never answers.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from channels import DEFAULT_CHANNEL_LAYER
from channels.db import database_sync_to_async
from channels.layers import channel_layers, get_channel_layer
from channels_redis.core import RedisChannelLayer
from django.utils import timezone

from tasks_app import consumers, eventloop, relay
from tasks_app.models import Membership, RemoteTask
from tasks_app.runtime.net import wait_until
from tests import test_consumers, test_ui_resync
from tests.agents import REPO_ROOT
from tests.test_consumers import communicator, until_type, write, write_many
from tests.test_ui_resync import Server

# Their fixtures: a private channel-layer prefix (autouse), a task, a member; a daphne of
# its own for this module and a logged-in Chromium on it.
private_layer = test_consumers.private_layer
task = test_consumers.task
user = test_consumers.user
server = test_ui_resync.server
context = test_ui_resync.context

sockets = pytest.mark.django_db(transaction=True)


def take_the_role(person: Any) -> None:
    """The membership removed the ordinary way: its news (``access.changed``) is relayed."""
    Membership.objects.filter(user=person).delete()


def take_the_role_silently(person: Any) -> None:
    """The same, with the news lost (a Redis hiccup)."""
    with mock.patch("tasks_app.relay.publish", lambda messages: None):
        take_the_role(person)


# Access changed inside the socket's own window ---------------------------------------------


@sockets
@pytest.mark.timeout(60)
async def test_a_task_socket_whose_access_goes_right_after_its_check_is_closed(
    task, user, monkeypatch
):
    """The role was taken between connect's readable check and its join of the person's
    group: the news went to a group the socket was not in yet, and it read the log and
    forwarded live rows until its recheck a minute later. Joined first, it is told."""
    await database_sync_to_async(write)(task.pk, 1)
    original = consumers._task_readable
    calls = 0

    async def then_taken(person: Any, pk: int) -> bool:
        nonlocal calls
        calls += 1
        readable = await original(person, pk)
        if calls == 1:  # connect's check: the role goes right after it
            await database_sync_to_async(take_the_role)(user)
        return readable

    monkeypatch.setattr(consumers, "_task_readable", then_taken)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    closed = await comm.receive_output(timeout=5)
    while closed["type"] != "websocket.close":  # the resume's own messages come first
        closed = await comm.receive_output(timeout=5)
    assert closed["code"] == consumers.CLOSE_NOT_FOUND


@sockets
@pytest.mark.timeout(60)
async def test_a_list_socket_whose_access_goes_right_after_its_read_forwards_nothing_of_it(
    task, user, monkeypatch
):
    original = consumers._readable_agent_ids
    calls = 0

    async def then_taken(person: Any) -> set[int] | None:
        nonlocal calls
        calls += 1
        ids = await original(person)
        if calls == 1:
            await database_sync_to_async(take_the_role)(user)
        return ids

    monkeypatch.setattr(consumers, "_readable_agent_ids", then_taken)
    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    summary = {"type": "tasks.changed", "task": task.pk, "agent": task.agent_id, "last_seq": 3}
    await get_channel_layer().group_send(relay.LIST_GROUP, summary)
    assert await comm.receive_nothing(timeout=1)
    await comm.disconnect()


@sockets
@pytest.mark.timeout(60)
async def test_access_due_a_check_is_checked_between_the_reads_of_a_long_resume(
    task, user, monkeypatch
):
    """A resume of a long log is one handler, read after read: access that fell due in it
    (and went, its news lost) was not looked at until the whole log had been sent."""
    await database_sync_to_async(write_many)(task.pk, 1, 600)  # two reads of BATCH
    original = consumers._read_log
    calls = 0

    async def taken_after_the_first(
        task_pk: int, after: int, upto: int | None, limit: int
    ) -> list[dict]:
        nonlocal calls
        calls += 1
        rows = await original(task_pk, after, upto, limit)
        if calls == 1:
            await database_sync_to_async(take_the_role_silently)(user)
            monkeypatch.setattr(consumers, "ACCESS_RECHECK_SECONDS", 0.0)  # due from now on
        return rows

    monkeypatch.setattr(consumers, "_read_log", taken_after_the_first)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    seqs = []
    while (out := await comm.receive_output(timeout=10))["type"] != "websocket.close":
        message = json.loads(out["text"])
        assert message["type"] == "event", message
        seqs.append(message["seq"])
    assert out["code"] == consumers.CLOSE_NOT_FOUND
    assert seqs == list(range(1, consumers.BATCH + 1))


# A list re-sync after more changes than one answer holds -----------------------------------


@sockets
@pytest.mark.timeout(60)
async def test_a_list_sync_cut_at_its_limit_goes_on_where_it_stopped(task, user):
    """Newest first and cut at the limit, the answer's version jumped past the older
    changes it left out, and no later sync asked for them again (a list page back after an
    outage in which many tasks changed showed the older ones stale for good). Following
    ``more`` as the page does, every changed task arrives, once each."""
    limit = consumers.LIST_SYNC_LIMIT
    base = timezone.now() - timedelta(hours=1)

    @database_sync_to_async
    def changed_apart_and_together() -> list[int]:
        made = RemoteTask.objects.bulk_create(
            RemoteTask(agent_id=task.agent_id, title=f"t{i}") for i in range(2 * limit + 50)
        )
        # Spread wider than the overlap, then the last ones all at one time (one update):
        # the next answer must go on by pk among equal times.
        for i, one in enumerate(made[: limit + 50]):
            RemoteTask.objects.filter(pk=one.pk).update(updated_at=base + timedelta(seconds=i))
        together = [one.pk for one in made[limit + 50 :]]
        RemoteTask.objects.filter(pk__in=together).update(updated_at=base + timedelta(hours=1))
        RemoteTask.objects.filter(pk=task.pk).update(updated_at=base - timedelta(hours=1))
        return [one.pk for one in made]

    changed = await changed_apart_and_together()
    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    seen: list[int] = []
    request: dict = {"type": "sync", "since": (base - timedelta(minutes=5)).isoformat()}
    for _ in range(4):
        await comm.send_json_to(request)
        rows, answer = await until_type(comm, "version")
        seen += [m["task"] for m in rows]
        if "more" not in answer:
            break
        assert len(rows) == limit
        request = {"type": "sync", "since": answer["version"], "after": answer["more"]}
    else:
        pytest.fail("the answers never came to an end")
    assert sorted(seen) == sorted(changed)
    assert answer["version"] == (base + timedelta(hours=1)).isoformat()
    # A malformed ``after`` is a sync from ``since`` (with the overlap), as without one.
    since = (base - timedelta(minutes=5)).isoformat()
    await comm.send_json_to({"type": "sync", "since": since, "after": "x"})
    rows, again = await until_type(comm, "version")
    assert [m["task"] for m in rows] == seen[:limit] and again.get("more")
    await comm.disconnect()


# A Redis that takes connections and never answers (paused, partitioned) --------------------


@pytest.fixture
def silent_redis(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The default channel layer on a loopback server that accepts and never replies, with
    no socket timeout, as ``dashboard/settings.py`` configures the real one."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])  # read nothing, answer nothing
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    if eventloop.running():
        eventloop.stop()
    address = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    layer = RedisChannelLayer(hosts=[{"address": address, "socket_timeout": None}])
    monkeypatch.setitem(channel_layers.backends, DEFAULT_CHANNEL_LAYER, layer)
    try:
        yield
    finally:
        if eventloop.running():
            eventloop.stop()
        relay.use_loop(None)
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_synchronous_relay_gives_up_on_a_redis_that_never_answers(silent_redis):
    """A web request's relay after its commit waited on Redis for ever."""
    relay.use_loop(None)
    done = threading.Event()

    def publish() -> None:
        relay.publish([(relay.task_group(1), {"type": "task.event", "seq": 1})])
        done.set()

    threading.Thread(target=publish, daemon=True).start()
    assert done.wait(relay.SEND_SECONDS + 10), "publish() still waiting on Redis"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_relay_loop_counts_a_send_to_a_redis_that_never_answers_as_failed(silent_redis):
    """The worker's relay: one send that never ended held every later relay behind it,
    and its queue grew with every record() for as long as Redis kept silent."""
    eventloop.get_loop()  # the relay takes the layer above
    relay.publish([(relay.task_group(1), {"type": "task.event", "seq": 1})])
    assert wait_until(lambda: relay._loop_relay.failed_sends >= 1, relay.SEND_SECONDS + 10)


# In a browser -------------------------------------------------------------------------------

# Runs in a child process with the server's settings (as tests.test_ui_resync.WRITER).
WRITER = """
import json, sys
from unittest import mock
import django
django.setup()
from django.db import transaction
from django.utils import timezone
from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.services.record import record, record_many

op, arg = sys.argv[1], json.loads(sys.argv[2])

def status(state, text):
    return {"statusUpdate": {"taskId": "lv-1", "contextId": "lc-1", "status": {
        "state": state, "message": {"messageId": text, "role": "ROLE_AGENT", "parts": [{"text": text}]}}}}

lost = mock.patch("tasks_app.relay.publish", lambda messages: None)
if op == "tasks":  # arg others, then the watched task (newest: first on the list)
    n = RemoteTask.objects.count()  # several tests share the server: an agent each
    agent = Agent.objects.create(name=f"live {arg} {n}", base_url=f"http://127.0.0.1:1/lv{arg}-{n}/")
    others = RemoteTask.objects.bulk_create(RemoteTask(agent=agent, title=f"o{i}") for i in range(arg))
    task = RemoteTask.objects.create(agent=agent, title="watched")
    record(task.pk, {"task": {"id": "lv-1", "contextId": "lc-1", "status": {"state": "TASK_STATE_WORKING"}}}, "poll")
    print(json.dumps([task.pk, [t.pk for t in others]]))
elif op == "flood":  # the others changed at one time, then the watched task ends; none relayed
    with lost:
        RemoteTask.objects.filter(pk__in=arg[1]).update(updated_at=timezone.now())
        record(arg[0], status("TASK_STATE_COMPLETED", "done"), "poll")
    print("null")
elif op == "behind":  # arg[1] rows more, none relayed
    with lost:
        record_many(arg[0], [status("TASK_STATE_WORKING", f"more {i}") for i in range(arg[1])], "poll")
    print("null")
elif op == "hole":  # rows 2..4, none relayed, and row 2 gone from the log before anyone reads
    with lost, transaction.atomic():
        record_many(arg, [status("TASK_STATE_WORKING", f"step {i}") for i in (2, 3, 4)], "poll")
        TaskEvent.objects.filter(task_id=arg, seq=2).delete()
    print("null")
"""


def write_on(web: Server, op: str, arg: object = None) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", WRITER, op, json.dumps(arg)],
        cwd=REPO_ROOT, env=web.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


BROWSER_MARKS = [
    pytest.mark.browser, pytest.mark.server, pytest.mark.subprocess,
    pytest.mark.slow, pytest.mark.timeout(180),
]  # fmt: skip


def in_browser(test: Any) -> Any:
    """The marks of a test that starts daphne and drives Chromium (no database here: the
    server has its own)."""
    for mark in BROWSER_MARKS:
        test = mark(test)
    return test


@in_browser
def test_the_list_page_asks_for_the_rest_of_a_cut_answer(context, server):
    """More tasks changed (with their summaries lost) than one answer holds, the watched one
    last: the page asks for the rest at once, from where the answer stopped."""
    watched, others = write_on(server, "tasks", consumers.LIST_SYNC_LIMIT + 10)
    page = context.new_page()
    page.goto("/tasks/")
    page.wait_for_selector(f"#task-row-{watched} .badge:text-is('working')")
    page.wait_for_selector("#live-status[data-state=open]")
    write_on(server, "flood", [watched, others])
    page.wait_for_selector(f"#task-row-{watched} .badge:text-is('completed')", timeout=20_000)
    page.close()


@in_browser
def test_a_hole_in_the_log_is_taken_as_the_server_says_not_reconnected_on_for_ever(context, server):
    """The consumer says ``gap`` for a hole in the log itself and sends what follows; the
    page took the next row for a skipped seq, reconnected, met the hole again, for ever."""
    pk, _ = write_on(server, "tasks", 0)
    page = context.new_page()
    page.goto(f"/tasks/{pk}/")
    page.wait_for_function("() => window.__taskPage.synced && window.__taskPage.lastSeq === 1")
    write_on(server, "hole", pk)
    page.wait_for_function("() => window.__taskPage.lastSeq === 4", timeout=20_000)
    state = page.evaluate("({seqs: window.__taskPage.seqs, holes: window.__taskPage.holes})")
    assert state == {"seqs": [1, 3, 4], "holes": 1}
    page.close()


@in_browser
def test_a_page_too_far_behind_loads_again_and_resumes_after_the_newest_rows(context, server):
    """Away while more rows than one resume sends were appended: the server says ``reload``
    (consumers.RESUME_MAX_ROWS) and the page loads again, then follows from the newest."""
    pk, _ = write_on(server, "tasks", 0)
    page = context.new_page()
    page.goto(f"/tasks/{pk}/")
    page.wait_for_function("() => window.__taskPage.synced && window.__taskPage.lastSeq === 1")
    # Away for as long as the rows take to write (a slow machine took over 3 s), then back.
    page.evaluate("() => { window.__before = true; window.__taskPage.dropSocket(600_000); }")
    write_on(server, "behind", [pk, consumers.RESUME_MAX_ROWS + 1])
    page.evaluate(
        "() => { const s = window.__taskPage.socket; s.holdUntil = 0; clearTimeout(s.timer);"
        " s.connect(); }"
    )
    last = consumers.RESUME_MAX_ROWS + 2
    page.wait_for_function(
        f"() => !window.__before && window.__taskPage && window.__taskPage.synced "
        f"&& window.__taskPage.lastSeq === {last}",
        timeout=30_000,
    )
    page.close()
