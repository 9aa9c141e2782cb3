"""Websocket consumers: a browser follows one task's event log, or the task list.

``ws/tasks/<pk>/`` protocol (JSON messages):

* The browser connects with ``?after=<last seq it has>``, or connects without it
  and sends ``{"type": "resume", "after": N}``. Before a resume nothing is sent.
  A socket resumes once: a later ``resume`` is answered as a ``sync`` (the rows after
  the last one this socket sent), so a frame of a few bytes cannot ask for the whole
  log again and again. An ``after`` beyond the log's end counts from its end. One more
  than ``RESUME_MAX_ROWS`` rows behind, the socket does not resume: it answers
  ``{"type": "reload", "last_seq": N}`` and the page loads again.
* The consumer joins the group ``task-<pk>`` *first* (live messages queue up
  behind the handler that runs), *then* reads the log rows with ``seq > after``
  and sends them in order as ``{"type": "event", ...}``, then
  ``{"type": "synced", "last_seq": N}``.
* Live ``task.event`` messages are forwarded only when their seq is the next
  one; an older seq is dropped (already sent); a seq that skips ahead, or one
  whose raw JSON was left out for size, makes the consumer read the missing
  rows from the log first. So the browser sees every seq once, in order.
* ``task.watcher`` messages become ``{"type": "watcher", ...summary}``.
* Re-sync: a relay message can be lost (a Redis hiccup, a worker killed after its
  commit), and a lost *last* event would leave the page stale forever. So the
  browser sends ``{"type": "sync"}`` when it has heard nothing for a few seconds
  (and now and then anyway). The consumer joins its groups again (a membership that
  expired or a restarted Redis lost comes back), reads the log rows after the last
  seq it sent (one indexed range query, usually empty), sends them, then ``synced``.
  Once a minute (``ACCESS_RECHECK_SECONDS``) the person's access is checked again
  before anything more is sent, whatever the browser sends or not (a lost
  ``access.changed``), and the socket closes as that message would.

``ws/tasks/`` forwards ``tasks.changed`` summaries as ``{"type": "task", ...}``,
and answers ``{"type": "sync", "since": ISO}`` with the summaries changed since
then and ``{"type": "version", "version": ISO}``; an answer cut at its limit says
``"more": PK``, and the browser asks for the rest with ``{"type": "sync", "since":
that version, "after": PK}`` (see ``TaskListConsumer``).

Both refuse anonymous users (close code 4401; ``refuse`` says why it accepts first), and both join the
person's group ``person-<id>`` before they read what the person may see: told that the
person's access changed
(``tasks_app.access_changes``), a socket checks again and closes (4401 for a person
made inactive, 4404 for a task no longer readable) or, for the list, follows the
readable agents as they now are.
A handshake from another origin never reaches them: ``tasks_app.routing`` closes it
(4403) first; a path that is neither is refused by ``NoSuchSocket``. A socket whose
browser went away in the middle of a long send stops sending and still leaves its
groups. A frame that is not a JSON object is dropped (the protocol has no error
message); a malformed seq resumes from the start, a malformed ``since`` answers only the
version.

Frames are bounded per socket (``_FrameGate``): daphne queues whatever a browser sends
without limit (its own bound is 1 MiB a frame), and most frames cost a query. A frame over
``MAX_FRAME_CHARS`` is dropped unread, as a malformed one. Every frame spends one of
``FRAME_BURST`` tokens, given back at ``FRAME_RATE`` a second; a socket out of them is
closed (4429: the page waits a while before it connects again). A ``sync`` or ``resume``
that arrives while one waits its turn is merged into it (at most one re-sync runs and one
waits, whatever arrives); the task socket still answers each merged frame with the one
``synced``. A list ``sync`` that follows a ``more`` the socket just sent costs no token (a
long catch-up is one frame per answer). The pages send a ``sync`` at most every 5 s
(``live.js``). And sockets are bounded per person: each holds one of its person's
``BUDGET_PERSON_SOCKETS`` places, over every web process; past them the handshake
is refused with 4430 (the page says so and waits as after 4429).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from importlib import import_module
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from autobahn.exception import Disconnected
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer, AsyncWebsocketConsumer
from django.conf import settings
from django.db.models import Q

from tasks_app import access, socket_places
from tasks_app.models import RemoteTask, TaskEvent
from tasks_app.previews import sized_batch
from tasks_app.relay import LIST_GROUP, person_group, task_group
from tasks_app.services.record import task_summary
from tasks_app.services.snapshot import event_json

log = logging.getLogger(__name__)

BATCH = 500
BATCH_CHARS = 4 * 1024 * 1024  # of the rows' raw JSON a read takes at most (but one row)
# A row whose raw JSON is longer goes to the browser without it (``raw_cut``: its size; the
# page links to the row and redraws what it shows from the server). An agent's event goes up
# to WATCH_MAX_EVENT_BYTES, and every open page of the task got it whole, into its DOM.
SOCKET_RAW_CHARS = 64 * 1024
# A resume sends at most this many rows from the log. Further behind (a page left open
# through a long outage, or a socket asking ``?after=0`` of a long log), the page is told
# to load again (``reload``): it then shows the newest rows and resumes after them. One
# frame could otherwise ask for a whole log (a task may hold 64 MiB of content) to be
# queued in the server for a browser that need not read any of it.
RESUME_MAX_ROWS = 2_000
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
# List re-sync: how far before the browser's version to look again, and at most how many rows.
LIST_OVERLAP = timedelta(seconds=30)
LIST_SYNC_LIMIT = 200
# How often a socket's re-syncs also check its person's access afresh (seconds): the news of
# a change (``access.changed``) can be lost like any relay message. In between, an idle
# re-sync stays one query.
ACCESS_RECHECK_SECONDS = 60.0
# The largest seq the log can hold (``TaskEvent.seq`` is a PositiveIntegerField).
SEQ_MAX = 2**31 - 1
# What a browser may send on one socket (``_FrameGate``). The pages' frames are under 100
# characters, and they send a re-sync at most every 5 s (``live.js``: when idle 5 s, at
# least every 30 s; one more on each connect; one per ``more`` answer, which is free).
MAX_FRAME_CHARS = 4096  # longer: dropped unread (daphne itself closes at 1 MiB)
FRAME_BURST = 100  # frames a socket may send at once...
FRAME_RATE = 1.0  # ...and then this many a second, on average (a token bucket)
CLOSE_TOO_MANY_FRAMES = 4429  # as HTTP 429: the page backs off before it connects again
# The person holds ``BUDGET_PERSON_SOCKETS`` open sockets: the page says so and
# waits as after 4429 before it tries again.
CLOSE_TOO_MANY_SOCKETS = 4430
# No task changed before this: an older ``since`` asks for the same rows, and stays clear
# of datetime's range (``since - LIST_OVERLAP`` near year 1 overflows).
VERSION_FLOOR = datetime(1970, 1, 1, tzinfo=UTC)


def _authenticated(scope: dict) -> bool:
    user = scope.get("user")
    return bool(user is not None and getattr(user, "is_authenticated", False))


def event_message(event: TaskEvent, cut: int | None = None) -> dict[str, Any]:
    """A log row for the browser; ``cut``: its raw JSON's size, left out (read deferred)."""
    if cut is None:
        return {"type": "event", **event_json(event)}
    return {"type": "event", **event_json(event, with_raw=False), "raw_cut": cut}


def _seq(value: Any) -> int | None:
    """A seq as a browser sent it (number or digits); None when it is not one the log can hold.

    JSON from a browser may hold anything Python's json accepts: ``1e400`` and ``Infinity``
    (``int()`` raises OverflowError), ``NaN``, ``true``, a list. None and 0 both mean "none yet".
    """
    if value is None:
        return 0
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        value = int(value)
    elif isinstance(value, str):
        # ASCII digits only: int() also reads "1_000" and other scripts' digits.
        text = value.strip() or "0"
        if not _SEQ_TEXT.fullmatch(text):
            return None
        value = int(text)
    if not isinstance(value, int):
        return None
    return max(0, value) if value <= SEQ_MAX else None


_SEQ_TEXT = re.compile(r"-?[0-9]{1,12}")


def _decode_frame(text_data: str | None) -> dict[str, Any] | None:
    """A browser frame's JSON object; None for anything else (binary, empty, not JSON, not an
    object, nested too deep to parse)."""
    if not text_data:
        return None
    try:
        content = json.loads(text_data)
    except (ValueError, RecursionError):
        return None
    return content if isinstance(content, dict) else None


@database_sync_to_async
def _person_now(scope: dict) -> Any | None:
    """The person as the database has them now, while the socket's session holds; roles read
    afresh. None for a person gone or made inactive, and for a session that ended: logged
    out, or void since the person's password changed.

    Django's own check of a request's session decides (``auth.get_user`` on the session
    read afresh): it must still exist and carry the hash of the password as it is now. A
    socket opened on a session that a logout ended or a password change made void went on
    streaming, while HTTP requests with the same cookie were refused at once.
    """
    from django.contrib.auth import get_user

    key = getattr(scope.get("session"), "session_key", None)
    if not key:
        return None
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key=key)
    person = get_user(SimpleNamespace(session=store))
    if not person.is_authenticated or person.pk != scope["user"].pk:
        return None
    return person


@database_sync_to_async
def _task_readable(user: Any, pk: int) -> bool:
    """The task exists and is in one of the person's projects (the per-user lookup's rule)."""
    return access.readable_tasks(user).filter(pk=pk).exists()


@database_sync_to_async
def _readable_agent_ids(user: Any) -> set[int] | None:
    """Agents whose tasks the person may read; None for every agent (superuser)."""
    if access.projects_with(user, access.Perm.READ) is None:
        return None
    return set(access.readable_agents(user).values_list("pk", flat=True))


@database_sync_to_async
def _last_seq(task_pk: int) -> int:
    return RemoteTask.objects.filter(pk=task_pk).values_list("last_seq", flat=True).first() or 0


@database_sync_to_async
def _read_log(
    task_pk: int, after: int, upto: int | None, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """The next rows after ``after`` (at most ``limit``, and ``BATCH_CHARS`` of raw JSON but
    one row: ``previews.sized_batch``), and whether more follow. A row whose JSON is over
    ``SOCKET_RAW_CHARS`` goes without it (``raw_cut``)."""
    qs = TaskEvent.objects.filter(task_id=task_pk, seq__gt=after)
    if upto is not None:
        qs = qs.filter(seq__lte=upto)
    sizes, more = sized_batch(qs, limit, BATCH_CHARS)
    if not sizes:
        return [], False
    batch = qs.filter(seq__lte=max(sizes)).order_by("seq")
    big = [seq for seq, size in sizes.items() if size > SOCKET_RAW_CHARS]
    if not big:
        return [event_message(e) for e in batch], more
    # The big rows are read without their JSON, then put in order with the others.
    rows = [event_message(e) for e in batch.exclude(seq__in=big)]
    rows += [event_message(e, cut=sizes[e.seq]) for e in batch.filter(seq__in=big).defer("raw")]
    return sorted(rows, key=lambda row: row["seq"]), more


async def _join(consumer: AsyncJsonWebsocketConsumer, *groups: str) -> None:
    """Join ``groups``: on connect, and again on every re-sync the browser asks for.

    Membership does not last: channels_redis forgets it after its group expiry (a day by
    default) and a Redis restart forgets it at once, and a socket that lost its groups
    hears nothing live again, only what its re-syncs read. Joining again is one sorted-set
    add per group, and the browser asks for a re-sync at least every 30 s (``live.js``),
    so such a socket is live again within that. It joins before it reads: whatever
    commits after the read is then relayed to it.
    """
    for group in groups:
        await consumer.channel_layer.group_add(group, consumer.channel_name)


class _FrameGate:
    """Between the ASGI server's ``receive`` and the consumer: reads every message as it
    arrives (also while a handler runs) and bounds what a browser's frames may cost.

    * A frame over ``MAX_FRAME_CHARS`` is dropped unread (no JSON parse of it).
    * Every frame spends a token of the socket's bucket (``FRAME_BURST``, refilled at
      ``FRAME_RATE`` a second) unless the consumer says it is free (``free_frame``); with
      none left, the socket is closed (``CLOSE_TOO_MANY_FRAMES``).
    * A frame that is not a JSON object is dropped here; the others go to the consumer
      decoded (``content``).
    * A re-sync (``sync`` or ``resume``) that arrives while another waits its turn is
      merged into that one (its ``merged`` count): one re-sync runs, at most one waits.

    Once the socket is closed (by us, or its browser gone) frames are dropped unread, and
    what was waiting is dropped too; connect and disconnect always go through.
    """

    def __init__(self, consumer: _ResyncingConsumer, receive: Any) -> None:
        self.consumer = consumer
        self.upstream = receive
        self.queue: deque[dict[str, Any]] = deque()
        self.ready = asyncio.Event()
        self.waiting_resync: dict[str, Any] | None = None
        self.tokens = float(FRAME_BURST)
        self.filled_at = time.monotonic()
        self.failed: BaseException | None = None
        self.pump: asyncio.Future[None] | None = None

    def start(self) -> None:
        self.pump = asyncio.ensure_future(self._pump())

    async def stop(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.pump

    async def receive(self) -> dict[str, Any]:
        """The next message for the consumer (channels' dispatch loop calls this)."""
        while not self.queue:
            if self.failed is not None:
                raise self.failed
            self.ready.clear()
            await self.ready.wait()
        message = self.queue.popleft()
        if message is self.waiting_resync:
            self.waiting_resync = None  # it runs now: the next re-sync waits again
        return message

    def _put(self, message: dict[str, Any]) -> None:
        self.queue.append(message)
        self.ready.set()

    async def _pump(self) -> None:
        try:
            while True:
                message = await self.upstream()
                if message.get("type") == "websocket.receive":
                    await self._frame(message)
                    continue
                self._put(message)
                if message.get("type") == "websocket.disconnect":
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the server's receive failed: the consumer's fails so
            self.failed = error
            self.ready.set()

    def _spend(self) -> bool:
        now = time.monotonic()
        self.tokens = min(float(FRAME_BURST), self.tokens + (now - self.filled_at) * FRAME_RATE)
        self.filled_at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    async def _frame(self, message: dict[str, Any]) -> None:
        if self.consumer.gone:
            return
        text, data = message.get("text"), message.get("bytes")
        size = len(text) if text is not None else len(data or b"")
        # Longer than any frame of the protocol: dropped unread, as a malformed one is.
        content = _decode_frame(text) if text is not None and size <= MAX_FRAME_CHARS else None
        free = content is not None and self.consumer.free_frame(content)
        if not free and not self._spend():
            await self._close(CLOSE_TOO_MANY_FRAMES, "more frames than its budget")
            return
        if content is None:
            return  # not a JSON object: the protocol has no answer for it
        if content.get("type") in ("sync", "resume"):  # any JSON value: not a set lookup
            if self.waiting_resync is not None:
                self.waiting_resync["merged"] += 1
                return
            self.waiting_resync = {**message, "content": content, "merged": 0}
            self._put(self.waiting_resync)
            return
        self._put({**message, "content": content})

    async def _close(self, code: int, why: str) -> None:
        user = self.consumer.scope.get("user")
        log.warning(
            "websocket %s of person %s closed (%s): %s",
            self.consumer.scope.get("path"),
            getattr(user, "pk", None),
            code,
            why,
        )
        # Nothing that waited runs: the socket is closed.
        self.queue = deque(m for m in self.queue if m.get("type") != "websocket.receive")
        self.waiting_resync = None
        await self.consumer.close(code=code)


async def refuse(consumer: AsyncWebsocketConsumer, code: int) -> None:
    """Refuse a handshake with ``code``: accepted, then closed at once, nothing sent.

    A close before the accept is an HTTP 403 to the browser, which reports 1006 (no code),
    the same as a network cut: a page whose session had expired reconnected for ever instead
    of saying "log in again". The origin check does the same (``tasks_app.routing``).
    """
    await consumer.accept()
    await consumer.close(code=code)


class _ResyncingConsumer(AsyncJsonWebsocketConsumer):
    """What both sockets share: malformed frames dropped; the person's access checked afresh
    when due; sends stopped once the socket is closed or its browser gone; groups left
    however the socket ends."""

    joined: tuple[str, ...] = ()
    # Closed by us, or the browser went away: nothing more is sent.
    gone = False
    # How many frames were merged into the re-sync that runs (``_FrameGate``).
    merged = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_checked_at = time.monotonic()  # connect checks it
        self.renewing: asyncio.Future[None] | None = None  # None: the socket holds no place

    def _place(self) -> tuple[str, int, str]:
        prefix = getattr(self.channel_layer, "prefix", None) or "asgi"
        return prefix, self.scope["user"].pk, self.channel_name

    async def take_place(self) -> bool:
        """One of the person's ``BUDGET_PERSON_SOCKETS``; False (refused) past it. Renewed
        while the socket is open, whether its browser sends anything or not."""
        if not await sync_to_async(socket_places.take, thread_sensitive=False)(*self._place()):
            return False
        self.renewing = asyncio.ensure_future(self._renew_place())
        return True

    async def _renew_place(self) -> None:
        """Every ``RENEW_AFTER_SECONDS``: push the place's lapse further; a place lost (it
        lapsed while the process stalled, and others took the person's places) closes the
        socket, as a refused handshake would."""
        renew = sync_to_async(socket_places.renew, thread_sensitive=False)
        while not self.gone:
            await asyncio.sleep(socket_places.RENEW_AFTER_SECONDS)
            if not await renew(*self._place()):
                await self.close(code=CLOSE_TOO_MANY_SOCKETS)
                return

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Run the consumer with a send that knows when the socket is gone, and leave the
        groups at the end even when a handler failed (channels then skips ``disconnect``,
        and the groups would keep a dead channel until their expiry, a day)."""

        async def guarded_send(message: dict[str, Any]) -> None:
            if self.gone:
                return
            try:
                await send(message)
            except (Disconnected, OSError):
                # daphne raises Disconnected for a send after the browser left (a long
                # resume outlives the tab); ASGI servers in general raise an OSError.
                self.gone = True
                return
            if message.get("type") == "websocket.close":
                self.gone = True

        gate = _FrameGate(self, receive)
        gate.start()
        try:
            await super().__call__(scope, gate.receive, guarded_send)
        finally:
            await gate.stop()
            await self._leave()

    async def join(self, *groups: str) -> None:
        self.joined = groups
        await _join(self, *groups)

    async def _leave(self) -> None:
        if self.renewing is not None:
            renewing, self.renewing = self.renewing, None
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            await sync_to_async(socket_places.give_back, thread_sensitive=False)(*self._place())
        joined, self.joined = self.joined, ()
        for group in joined:
            try:
                await self.channel_layer.group_discard(group, self.channel_name)
            except Exception:  # Redis away: the group's expiry drops the channel instead
                log.warning("could not leave %s", group, exc_info=True)

    async def disconnect(self, code: int) -> None:
        await self._leave()

    async def websocket_receive(self, message: dict[str, Any]) -> None:
        """A frame as the gate passed it on: decoded, and with how many were merged into it."""
        if "content" not in message:
            await super().websocket_receive(message)
            return
        self.merged = message.get("merged", 0)
        try:
            await self.receive_json(message["content"])
        finally:
            self.merged = 0

    def free_frame(self, content: dict[str, Any]) -> bool:
        """Whether a frame costs no token of the socket's budget (``_FrameGate``)."""
        return False

    async def answer(self, content: dict[str, Any]) -> None:
        """The answer that ends a re-sync, once for each frame it answers (merged ones too)."""
        for _ in range(1 + self.merged):
            await self.send_json(content)

    async def receive(
        self, text_data: str | None = None, bytes_data: bytes | None = None, **kwargs: Any
    ) -> None:
        """Only JSON objects reach ``receive_json``; anything else is dropped. The base class
        raises on it, which ends the socket (1011) and can skip the groups' discard. The
        protocol has no error message (the pages ignore unknown types), so none is sent."""
        content = _decode_frame(text_data)
        if content is not None:
            await self.receive_json(content, **kwargs)

    def access_due(self) -> bool:
        """Whether access should be checked again before more is sent (``ACCESS_RECHECK_SECONDS``)."""
        return time.monotonic() - self.access_checked_at >= ACCESS_RECHECK_SECONDS

    async def may_go_on(self) -> bool:
        """Before anything is sent: False when the socket is gone, or when access was due a
        check and failed it (the socket is closed then). Live rows and summaries pass here
        too, so a socket whose browser never asks for a re-sync is checked all the same."""
        if self.gone:
            return False
        if self.access_due():
            return await self.check_access()
        return True

    async def check_access(self) -> bool:
        raise NotImplementedError


class TaskConsumer(_ResyncingConsumer):
    """Follows one task's log with resume-after-seq: no gap, no duplicate."""

    task_pk: int
    last_sent: int | None = None  # None until the browser said where it is

    async def connect(self) -> None:
        if not _authenticated(self.scope):
            await refuse(self, CLOSE_UNAUTHENTICATED)
            return
        if not await self.take_place():
            await refuse(self, CLOSE_TOO_MANY_SOCKETS)
            return
        self.task_pk = int(self.scope["url_route"]["kwargs"]["task_id"])
        # Join first: whatever is appended from now on is queued for us, and so is the news
        # of a change of access committed after the check below (checked first, that news
        # went to a group the socket was not in yet, and it read on until its recheck).
        await self.join(task_group(self.task_pk), person_group(self.scope["user"].pk))
        # Not found and not readable look the same: another project's tasks are not revealed.
        if not await _task_readable(self.scope["user"], self.task_pk):
            await refuse(self, CLOSE_NOT_FOUND)
            return
        await self.accept()
        after = self._after_from_query()
        if after is not None:
            await self._resume(after)

    def _after_from_query(self) -> int | None:
        # Not UTF-8 (a raw client's bytes; browsers percent-encode): what it says is replaced.
        query = parse_qs((self.scope.get("query_string") or b"").decode("utf-8", "replace"))
        values = query.get("after")
        if not values:
            return None
        after = _seq(values[0])
        return 0 if after is None else after  # malformed: everything (nothing is lost)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict) or not await self.may_go_on():
            return
        if content.get("type") == "resume":
            if self.last_sent is not None:  # resumed already: only what is new (see above)
                await self._resync(None)
                return
            after = _seq(content.get("after"))
            await self._resume(0 if after is None else after)  # malformed: everything
        elif content.get("type") == "sync":
            await self._resync(content.get("after"))
        elif content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    async def _resume(self, after: int) -> None:
        last = await _last_seq(self.task_pk)
        # Past the log's end (a stale page, or a page of a task whose number was used
        # again) counts from the end: rows appended later must not be taken as sent.
        after = min(after, last)
        if last - after > RESUME_MAX_ROWS:
            # Not resumed: live rows are not forwarded, a later resume or sync asks again.
            await self.send_json({"type": "reload", "last_seq": last})
            return
        self.last_sent = after
        await self._send_from_log(upto=None)
        await self.answer({"type": "synced", "last_seq": self.last_sent})

    async def _resync(self, after: Any) -> None:
        """Idle re-sync: send what the log holds beyond what we sent (a lost relay).

        Rows between the browser's seq and ours are on their way to it already, so
        we read after our own ``last_sent``; before any resume, this is one.

        1. The person's access was checked again if it was due (``may_go_on``): a lost
           ``access.changed`` message (the same loss as a lost row) must not leave a
           socket reading what it may not for longer than ``ACCESS_RECHECK_SECONDS``.
        2. The groups are joined again (see :func:`_join`).
        3. The log is read.
        """
        if self.joined:
            await _join(self, *self.joined)
        if self.last_sent is None:
            seq = _seq(after)
            await self._resume(0 if seq is None else seq)  # malformed: everything
            return
        await self._send_from_log(upto=None)
        await self.answer({"type": "synced", "last_seq": self.last_sent})

    async def _send_from_log(self, upto: int | None) -> None:
        """Send every row after ``last_sent`` (up to ``upto``) from the log, in order."""
        assert self.last_sent is not None
        while not self.gone:
            rows, more = await _read_log(self.task_pk, self.last_sent, upto, BATCH)
            for row in rows:
                if self.gone:
                    return
                if row["seq"] != self.last_sent + 1:
                    # The log itself has a hole (should not happen): say so, carry on.
                    await self.send_json(
                        {"type": "gap", "after": self.last_sent, "next": row["seq"]}
                    )
                await self.send_json(row)
                self.last_sent = row["seq"]
            if not more:
                return
            # A long log is many reads in one handler: access due a check is checked before
            # each further read, as before any other send.
            if not await self.may_go_on():
                return

    # Group messages ------------------------------------------------------------------------

    async def task_event(self, message: dict[str, Any]) -> None:
        if self.last_sent is None:
            return  # not resumed yet: the resume reads it from the log
        if not await self.may_go_on():
            return
        seq = int(message.get("seq") or 0)
        if seq <= self.last_sent:
            return  # already sent (from the log, or a duplicate relay)
        raw_json = message.get("raw_json")
        if seq > self.last_sent + 1 or not isinstance(raw_json, str):
            # A gap, or a row relayed without its JSON (too large): read from the log.
            await self._send_from_log(upto=seq)
            return
        out = {
            key: message.get(key)
            for key in ("task", "seq", "kind", "channel", "state", "note", "received_at")
        }
        out["type"] = "event"
        # The row's JSON text as the recorder wrote it (record._RelayMessages): spliced
        # in, not parsed and written again for every socket.
        await self.send(text_data=f'{(await self.encode_json(out))[:-1]},"raw":{raw_json}}}')
        self.last_sent = seq

    async def task_events(self, message: dict[str, Any]) -> None:
        """Several appended rows relayed as one message (see ``relay.pack``)."""
        for event in message.get("events") or []:
            await self.task_event(event)

    async def task_watcher(self, message: dict[str, Any]) -> None:
        if await self.may_go_on():
            await self.send_json({**message, "type": "watcher"})

    async def access_changed(self, message: dict[str, Any]) -> None:
        """The person's access changed (``tasks_app.access_changes``): still allowed to read?"""
        if not self.gone:
            await self.check_access()

    async def check_access(self) -> bool:
        """Whether the person may still read the task, as the database says now; when not,
        the socket is closed (4401 for a person gone or made inactive or a session ended,
        4404 otherwise)."""
        self.access_checked_at = time.monotonic()
        person = await _person_now(self.scope)
        if person is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return False
        if not await _task_readable(person, self.task_pk):
            await self.close(code=CLOSE_NOT_FOUND)
            return False
        self.scope["user"] = person
        return True


def _parse_version(value: Any) -> datetime | None:
    """The browser's ``since`` in UTC, between ``VERSION_FLOOR`` and now; None if malformed.

    A version from the future would hide changes, so it is now. Clamped before converting
    to UTC: a time near either end of datetime's range with an offset overflows there.
    """
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    now = datetime.now(UTC)
    if parsed > now:
        return now
    if parsed < VERSION_FLOOR:
        return VERSION_FLOOR
    return parsed.astimezone(UTC)


@database_sync_to_async
def _changed_since(
    agent_ids: set[int] | None, since: datetime | None, after: int | None = None
) -> tuple[list[dict[str, Any]], datetime | None, int | None]:
    """Summaries of the readable tasks changed since ``since`` (with the overlap), oldest
    first, the ``updated_at`` of the last one, and, when more changed than one answer holds,
    the pk of the last one (where the next answer goes on); one query on the ``updated_at``
    index. With ``after`` it is such a next answer: the tasks after ``(since, after)`` in
    that order, without the overlap (the first answer had it)."""
    tasks = (
        RemoteTask.objects.all()
        if agent_ids is None
        else RemoteTask.objects.filter(agent_id__in=agent_ids)
    )
    if since is None:
        newest = tasks.order_by("-updated_at").values_list("updated_at", flat=True).first()
        return [], newest, None
    fields = (
        "agent",
        "remote_id",
        "context_id",
        "title",
        "phase",
        "state",
        "last_seq",
        "watcher_status",
        "updated_at",
    )
    if after is None:
        changed = tasks.filter(updated_at__gte=since - LIST_OVERLAP)
    else:
        changed = tasks.filter(updated_at__gte=since).filter(
            Q(updated_at__gt=since) | Q(pk__gt=after)
        )
    # Oldest first, cut at the limit: newest first, the answer's version jumped past the
    # older changes it left out, and no later sync asked for them again.
    rows = list(changed.only(*fields).order_by("updated_at", "pk")[: LIST_SYNC_LIMIT + 1])
    more = rows[LIST_SYNC_LIMIT - 1].pk if len(rows) > LIST_SYNC_LIMIT else None
    rows = rows[:LIST_SYNC_LIMIT]
    return [task_summary(t) for t in rows], (rows[-1].updated_at if rows else None), more


class TaskListConsumer(_ResyncingConsumer):
    """Forwards task summaries for lists and the overview, and re-syncs them by version.

    The list's version is the newest ``RemoteTask.updated_at`` the browser knows
    of. Every ``record()`` that appends sets ``updated_at`` (with ``last_seq``) in
    its compare-and-set, so a task whose summary was lost has an ``updated_at``
    after the version the browser held when the loss happened. A ``sync`` with
    ``since`` answers the summaries of the tasks changed from ``since`` minus
    ``LIST_OVERLAP`` (one range query on the ``updated_at`` index, bounded by
    ``LIST_SYNC_LIMIT``, oldest first), then the new version. An answer cut at the
    limit says ``more`` (the last task's pk) with the last task's ``updated_at`` as its
    version, and the browser asks at once for the tasks after that pair (without the
    overlap), until an answer is not cut: a page back after an outage in which more
    tasks changed gets all of them, not only the newest. The overlap is there because
    ``updated_at`` is taken before commit: a transaction that took its time
    earlier but committed after a newer one (or on a clock a little behind)
    must still be seen. Repeats are
    harmless, the browser keeps a row only when its ``last_seq`` is newer (or its
    phase or watcher changed). Without ``since`` (or with a malformed one) only
    the current version is answered.

    Not covered: a lost watcher-status change (it does not touch ``updated_at``)
    waits for the task's next change.
    """

    # Agents whose tasks this person may read (None: all); an agent added later is looked
    # up once when its first summary arrives.
    agent_ids: set[int] | None = None
    unreadable: set[int]
    # The ``sync`` the browser asks next after an answer that said ``more`` (free: see
    # ``free_frame``), as (version, pk).
    continuation: tuple[str, int] | None = None

    async def connect(self) -> None:
        if not _authenticated(self.scope):
            await refuse(self, CLOSE_UNAUTHENTICATED)
            return
        if not await self.take_place():
            await refuse(self, CLOSE_TOO_MANY_SOCKETS)
            return
        self.unreadable = set()
        # Joined before the read, as the task socket: a change of access after it is told.
        await self.join(LIST_GROUP, person_group(self.scope["user"].pk))
        self.agent_ids = await _readable_agent_ids(self.scope["user"])
        await self.accept()

    async def access_changed(self, message: dict[str, Any]) -> None:
        """The person's access changed: summaries follow the readable agents as they are now."""
        if not self.gone:
            await self.check_access()

    async def check_access(self) -> bool:
        """Read the person's readable agents afresh; False (and closed, 4401) for a person
        gone or made inactive, or a session ended."""
        self.access_checked_at = time.monotonic()
        person = await _person_now(self.scope)
        if person is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return False
        self.scope["user"] = person
        self.agent_ids = await _readable_agent_ids(person)
        self.unreadable = set()
        return True

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        # Access as it is now when due (a lost access change must not widen what is read
        # for long: may_go_on), then for a sync the groups joined again (see _join) and the read.
        if not isinstance(content, dict) or not await self.may_go_on():
            return
        if content.get("type") == "sync":
            if self.joined:
                await _join(self, *self.joined)
            since = _parse_version(content.get("since"))
            after = _seq(content.get("after")) or None  # malformed: a sync from ``since``
            summaries, newest, more = await _changed_since(self.agent_ids, since, after)
            for summary in summaries:
                await self.send_json({**summary, "type": "task", "resync": True})
            if more is not None:  # the rest from the last one sent, asked for at once
                assert newest is not None
                # Once, merged frames or not: each copy would ask for the rest again.
                self.continuation = (newest.isoformat(), more)
                await self.send_json(
                    {"type": "version", "version": self.continuation[0], "more": more}
                )
                return
            version = max((v for v in (since, newest) if v is not None), default=None)
            await self.answer(
                {"type": "version", "version": version.isoformat() if version else None}
            )
        elif content.get("type") == "ping":
            await self.send_json({"type": "pong"})

    def free_frame(self, content: dict[str, Any]) -> bool:
        """The ``sync`` that asks for the rest of an answer cut at its limit, as the page
        does at once (one frame per answer of ``LIST_SYNC_LIMIT`` rows, however many),
        costs no token: once per ``more`` sent."""
        wanted = self.continuation
        if (
            wanted is None
            or content.get("type") != "sync"
            or (content.get("since"), content.get("after")) != wanted
        ):
            return False
        self.continuation = None
        return True

    async def tasks_changed(self, message: dict[str, Any]) -> None:
        if await self.may_go_on() and await self._may_read(message.get("agent")):
            await self.send_json({**message, "type": "task"})

    async def tasks_summaries(self, message: dict[str, Any]) -> None:
        """Several tasks' summaries relayed in one message (``relay.summarize``)."""
        for summary in message.get("summaries", ()):
            await self.tasks_changed(summary)

    async def _may_read(self, agent_id: Any) -> bool:
        """Only summaries of readable agents' tasks go out (lists never show more)."""
        if self.agent_ids is None:
            return True
        if not isinstance(agent_id, int) or agent_id in self.unreadable:
            return False
        if agent_id not in self.agent_ids:
            fresh = await _readable_agent_ids(self.scope["user"])
            self.agent_ids = fresh if fresh is not None else self.agent_ids
            if fresh is not None and agent_id not in fresh:
                self.unreadable.add(agent_id)
                return False
        return True


class NoSuchSocket(AsyncWebsocketConsumer):
    """Any other websocket path: the handshake is refused (no route used to raise, which
    daphne logged as an error with its traceback, for anyone who asked)."""

    async def connect(self) -> None:
        await refuse(self, CLOSE_NOT_FOUND)
