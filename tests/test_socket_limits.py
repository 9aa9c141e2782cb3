"""What a browser's frames may cost a socket, and what the pages do when a socket is refused.

A ``sync`` or ``resume`` frame is a few bytes and costs the server group joins and a read of
the database; nothing bounded how many a socket sent (daphne queues them all). Now one
re-sync runs and at most one waits (what arrives meanwhile is merged into it), each socket
has a budget of frames (``consumers.FRAME_BURST``, refilled at ``FRAME_RATE`` a second) and
is closed with 4429 past it, and a frame longer than any of the protocol is dropped unread.
The sockets are flooded for real (channels' communicator on the websocket routes, the real
Redis channel layer of ``tests.test_consumers``), and the reads are counted.

In the browser (daphne and a logged-in Chromium, as ``tests.test_ui_resync``): a socket
closed with 4403 (refused) is not opened again, and the page says so; closed with 4429,
it waits before it opens again; a refused handshake reaches the browser with its code.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest
from channels.db import database_sync_to_async
from django.utils import timezone

from tasks_app import consumers
from tasks_app.models import RemoteTask
from tests import test_consumers, test_ui_resync
from tests.test_consumers import communicator, until_type, write
from tests.test_live_view_fixes import in_browser, write_on

# Their fixtures: a private channel-layer prefix (autouse), a task, a member; a daphne of
# its own for this module and a logged-in Chromium on it.
private_layer = test_consumers.private_layer
task = test_consumers.task
user = test_consumers.user
server = test_ui_resync.server
context = test_ui_resync.context


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of one of the consumers' database reads (a list of one counter)."""
    original = getattr(consumers, name)
    calls = [0]

    async def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await original(*args, **kwargs)

    monkeypatch.setattr(consumers, name, counted)
    return calls


async def until_closed(comm: Any, timeout: float = 10) -> tuple[list[dict], int | None]:
    """Every message until the socket is closed, and the close code."""
    messages: list[dict] = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"never closed; got {len(messages)} messages"
        out = await comm.receive_output(timeout=remaining)
        if out["type"] == "websocket.close":
            return messages, out.get("code")
        messages.append(json.loads(out["text"]))


# One re-sync at a time -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "resume"])
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_frames_that_arrive_while_a_resync_runs_wait_as_one(task, user, monkeypatch, kind):
    """Forty frames sent while a re-sync reads the log were forty more joins and reads, one
    after the other. Now they wait as one re-sync (two reads in all), and each frame is
    still answered (the page counts on an answer to each)."""
    await database_sync_to_async(write)(task.pk, 1)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    await until_type(comm, "synced")
    original = consumers._read_log
    reads = 0
    started, release = asyncio.Event(), asyncio.Event()

    async def held(*args: Any) -> list[dict]:
        nonlocal reads
        reads += 1
        if reads == 1:  # the first re-sync runs until the flood is in
            started.set()
            await release.wait()
        return await original(*args)

    monkeypatch.setattr(consumers, "_read_log", held)
    joins = counting(monkeypatch, "_join")
    await comm.send_json_to({"type": "sync", "after": 1})
    await asyncio.wait_for(started.wait(), 5)
    flood = 40
    for _ in range(flood):
        await comm.send_json_to({"type": kind, "after": 1})
    await asyncio.sleep(0.2)  # all of them arrived while the first one runs
    release.set()
    answers = [await comm.receive_json_from(timeout=5) for _ in range(flood + 1)]
    assert answers == [{"type": "synced", "last_seq": 1}] * (flood + 1)
    assert await comm.receive_nothing(timeout=0.3)
    assert (reads, joins[0]) == (2, 2)
    # Then as ever: a row whose relay was lost comes with the next sync.
    await database_sync_to_async(test_consumers.record_with_relay_lost)(
        task.pk, test_consumers.status(2)
    )
    await comm.send_json_to({"type": "sync", "after": 1})
    events, synced = await until_type(comm, "synced")
    assert [m["seq"] for m in events] == [2] and synced["last_seq"] == 2
    await comm.disconnect()


# A budget of frames per socket ------------------------------------------------------------

FLOODS = [
    pytest.param("task", {"type": "sync", "after": 0}, id="task-sync"),
    pytest.param("task", {"type": "resume", "after": 0}, id="task-resume"),
    pytest.param("list", {"type": "sync", "since": "2000-01-01T00:00:00+00:00"}, id="list-sync"),
    pytest.param("list", {"type": "ping"}, id="list-ping"),
]


@pytest.mark.parametrize(("socket", "frame"), FLOODS)
@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_a_socket_that_sends_more_frames_than_its_budget_is_closed(
    task, user, monkeypatch, socket, frame
):
    """Past ``FRAME_BURST`` frames at once the socket is closed with 4429, and what it sent
    meanwhile is not read: the flood costs at most the re-sync that ran and the one that
    waited."""
    await database_sync_to_async(write)(task.pk, 1)
    path = f"/ws/tasks/{task.pk}/?after=0" if socket == "task" else "/ws/tasks/"
    comm = await communicator(path, user)
    assert (await comm.connect())[0]
    if socket == "task":
        await until_type(comm, "synced")  # the resume of the connect
    reads = counting(monkeypatch, "_read_log")
    list_reads = counting(monkeypatch, "_changed_since")
    joins = counting(monkeypatch, "_join")
    for _ in range(consumers.FRAME_BURST + 50):
        await comm.send_json_to(frame)
    _messages, code = await until_closed(comm)
    assert code == consumers.CLOSE_TOO_MANY_FRAMES == 4429
    assert reads[0] + list_reads[0] <= 2 and joins[0] <= 2
    await comm.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_the_budget_comes_back_at_its_rate(task, user):
    """A socket that spent its budget at once may send ``FRAME_RATE`` frames a second from
    then on (more than the pages ever send: a sync every 5 s), and is closed past that."""
    await database_sync_to_async(write)(task.pk, 1)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    await until_type(comm, "synced")
    for _ in range(consumers.FRAME_BURST):
        await comm.send_json_to({"type": "sync", "after": 1})
    for _ in range(consumers.FRAME_BURST):
        assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 1}
    for _ in range(3):
        await asyncio.sleep(1.1 / consumers.FRAME_RATE)
        await comm.send_json_to({"type": "sync", "after": 1})
        assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 1}
    await comm.send_json_to({"type": "sync", "after": 1})
    await comm.send_json_to({"type": "sync", "after": 1})
    _messages, code = await until_closed(comm)
    assert code == consumers.CLOSE_TOO_MANY_FRAMES
    await comm.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_a_long_list_catch_up_is_not_held_against_the_budget(task, user, monkeypatch):
    """A list page back after an outage asks for the rest of each answer cut at its limit,
    at once, as many times as it takes: those frames cost nothing. Any other is counted."""
    monkeypatch.setattr(consumers, "LIST_SYNC_LIMIT", 2)
    monkeypatch.setattr(consumers, "FRAME_BURST", 4)
    base = timezone.now() - timedelta(hours=1)

    @database_sync_to_async
    def changed() -> list[int]:
        made = RemoteTask.objects.bulk_create(
            RemoteTask(agent_id=task.agent_id, title=f"t{i}") for i in range(30)
        )
        for i, one in enumerate(made):
            RemoteTask.objects.filter(pk=one.pk).update(updated_at=base + timedelta(minutes=i))
        RemoteTask.objects.filter(pk=task.pk).update(updated_at=base - timedelta(hours=1))
        return [one.pk for one in made]

    made = await changed()
    comm = await communicator("/ws/tasks/", user)
    assert (await comm.connect())[0]
    seen: list[int] = []
    request: dict = {"type": "sync", "since": (base - timedelta(minutes=5)).isoformat()}
    answers = 0
    while True:  # as live.js does: the rest at once, from where the answer stopped
        await comm.send_json_to(request)
        rows, answer = await until_type(comm, "version")
        answers += 1
        seen += [m["task"] for m in rows]
        if "more" not in answer:
            break
        request = {"type": "sync", "since": answer["version"], "after": answer["more"]}
    assert answers > 3 * consumers.FRAME_BURST and sorted(set(seen)) == sorted(made)
    # The same frame again, no answer having asked for it, is counted as any other.
    for _ in range(consumers.FRAME_BURST + 1):
        await comm.send_json_to(request)
    _messages, code = await until_closed(comm)
    assert code == consumers.CLOSE_TOO_MANY_FRAMES
    await comm.disconnect()


# A bound on a frame's size ----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_a_frame_longer_than_any_of_the_protocol_is_dropped_unread(task, user, monkeypatch):
    """The pages' frames are under 100 characters; one of a megabyte was parsed and
    answered. Over ``MAX_FRAME_CHARS`` it is dropped as a malformed frame is, unread."""
    await database_sync_to_async(write)(task.pk, 1)
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    await until_type(comm, "synced")
    reads = counting(monkeypatch, "_read_log")
    decoded: list[int] = []
    original = consumers._decode_frame

    def measured(text: str | None) -> Any:
        decoded.append(len(text or ""))
        return original(text)

    monkeypatch.setattr(consumers, "_decode_frame", measured)

    def padded(size: int) -> str:
        frame = json.dumps({"type": "sync", "after": 1, "pad": ""})
        return frame.replace('"pad": ""', '"pad": "' + "x" * (size - len(frame)) + '"')

    for size in (consumers.MAX_FRAME_CHARS + 1, 1_000_000):
        await comm.send_to(text_data=padded(size))
    assert await comm.receive_nothing(timeout=0.5)
    assert reads[0] == 0 and decoded == []
    await comm.send_to(text_data=padded(consumers.MAX_FRAME_CHARS))  # the longest one read
    assert await comm.receive_json_from(timeout=5) == {"type": "synced", "last_seq": 1}
    assert reads[0] == 1 and decoded == [consumers.MAX_FRAME_CHARS]
    await comm.disconnect()


# In a browser -----------------------------------------------------------------------------


def refusing(code: int, opened: list[str]) -> Callable[[Any], None]:
    """A route for the pages' sockets that closes each one with ``code`` as the server would
    (the page's socket opens, then the close frame with that code arrives)."""

    def route(ws: Any) -> None:
        opened.append(urlsplit(ws.url).path)
        ws.close(code=code, reason="closed by the test")

    return route


@in_browser
def test_pages_whose_socket_is_refused_stop_and_say_so(context, server):
    """Closed with 4403 (another origin, or access denied), the list page connected again
    and again, for ever, with nothing said; so did the task page. Now neither connects
    again, and the page's "live:" line says it was refused."""
    pk, _ = write_on(server, "tasks", 0)
    for url in ("/tasks/", f"/tasks/{pk}/"):
        opened: list[str] = []
        page = context.new_page()
        page.route_web_socket(re.compile(r"/ws/tasks/"), refusing(4403, opened))
        page.goto(url)
        page.wait_for_selector("#live-status[data-state=closed]")
        assert page.text_content("#live-status") == "live: refused by the server (not reconnecting)"
        page.wait_for_timeout(4000)  # the backoff connected again within 0.4 s, then 0.8 s, ...
        # One socket each: the task page's own, and the inbox badge's list socket.
        expected = (
            ["/ws/tasks/"] if url == "/tasks/" else sorted(["/ws/tasks/", f"/ws/tasks/{pk}/"])
        )
        assert sorted(opened) == expected, url
        assert page.get_attribute("#live-status", "data-state") == "closed"
        page.close()


@contextlib.contextmanager
def another_origin() -> Iterator[str]:
    """The URL of a page served on 127.0.0.1 at a port of its own, while in the block."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><p>another origin</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


CLOSE_CODE_OF = """(url) => new Promise((done) => {
    const ws = new WebSocket(url);
    const got = [];
    ws.onmessage = (e) => got.push(e.data);
    ws.onclose = (e) => done({code: e.code, messages: got});
    setTimeout(() => done({code: "still open after 10 s", messages: got}), 10000);
})"""


@in_browser
def test_a_browser_learns_why_its_socket_was_refused(context, server):
    """A refused handshake was closed before the accept: daphne answered it with an HTTP
    403 and the browser reported 1006, as for a network cut, so a page on a misconfigured
    site, or whose session had expired, never learned it was refused and connected again for
    ever. Now the socket closes with the refusal's code, and nothing else arrives."""
    ws_base = server.base_url.replace("http://", "ws://")
    page = context.new_page()
    # Another origin on the same machine: the same host at another port (Chromium refuses
    # loopback sockets to pages of public or opaque origins before any handshake).
    with another_origin() as other:
        page.goto(other)
        closed = page.evaluate(CLOSE_CODE_OF, ws_base + "/ws/tasks/")
    assert closed == {"code": 4403, "messages": []}
    page.goto("/tasks/")  # the person's own origin, logged in: no such socket path
    assert page.evaluate(CLOSE_CODE_OF, ws_base + "/ws/nothing/") == {"code": 4404, "messages": []}
    page.close()
    # Nobody logged in (as after the session expired).
    anonymous = context.browser.new_context(base_url=server.base_url)
    try:
        page = anonymous.new_page()
        page.goto("/login/")
        for path in ("/ws/tasks/", "/ws/tasks/1/"):
            closed = page.evaluate(CLOSE_CODE_OF, ws_base + path)
            assert closed == {"code": 4401, "messages": []}, path
    finally:
        anonymous.close()


@in_browser
@pytest.mark.parametrize(
    ("code", "words"),
    [
        (consumers.CLOSE_TOO_MANY_FRAMES, "too many requests"),
        (consumers.CLOSE_TOO_MANY_SOCKETS, r"too many live pages open \(close some\)"),
    ],
)
def test_a_page_closed_for_too_many_frames_waits_before_it_connects_again(
    context, server, code, words
):
    """Closed with 4429 (past its socket's budget of frames) or 4430 (its person holds as
    many sockets as they may) the page waits half a minute or more, and says which, rather
    than connecting again at once."""
    opened: list[str] = []
    page = context.new_page()
    page.route_web_socket(re.compile(r"/ws/tasks/"), refusing(code, opened))
    page.goto("/tasks/")
    page.wait_for_selector("#live-status[data-state=reconnecting]")
    status = page.text_content("#live-status") or ""
    match = re.fullmatch(rf"live: {words}, reconnecting in ([0-9.]+) s", status)
    assert match and 30 <= float(match.group(1)) <= 60, status
    page.wait_for_timeout(4000)
    assert opened == ["/ws/tasks/"]
    page.close()
