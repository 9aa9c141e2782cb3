"""Watchers: hold a task's outbound stream or polling loop, and feed ``record()``.

Shape (docs/architecture.md has the why):

* ``watch(task_pk)`` is a Celery task. It takes the task's **lease** by
  compare-and-set and starts a :class:`Holder` on the worker process's shared
  asyncio loop (``tasks_app.eventloop``), then returns at once: hundreds of
  streams share one loop and one HTTP client, and the broker never holds a
  long-running task (so its re-delivery rules do not matter).
* One heartbeat per process renews all the leases it holds; a holder whose
  lease was lost is canceled.
* A holder works for a bounded **slice**, then releases the lease and
  dispatches its own continuation; ``reconcile()`` (celery beat) dispatches
  every watchable task whose lease expired, e.g. after a worker was killed.

A holder's algorithm:

1. If the task has something to send (the first message, or an answer), send
   it in the task's mode. A send that fails before the agent names a task is
   marked failed, never retried blindly; a send interrupted by a crash is not
   repeated (the agent may have created the task).
2. While the slice lasts and the task is neither terminal nor waiting for
   input: stream (``SubscribeToTask``; its first snapshot is recorded on the
   ``resubscribe`` channel, where a differing snapshot adds a gap event) or
   poll (``GetTask``, backing off while nothing changes). A stream that closes
   on a non-terminal state is checked with ``GetTask``; a subscribe refused on
   a terminal task falls back to ``GetTask``; transport failures back off
   exponentially with jitter and mark the agent unreachable.
3. ``input-required`` ends the turn (a person answers; that dispatches a new
   watcher); ``auth-required`` keeps watching to see the agent resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from celery import shared_task
from celery.signals import worker_shutting_down
from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from tasks_app import eventloop, outbound
from tasks_app.a2a import (
    A2AClient,
    A2AError,
    ConnectError,
    InvalidParamsError,
    ProtocolError,
    RemoteError,
    StreamEvent,
    TaskNotFoundError,
    TransportError,
    UnsupportedOperationError,
)
from tasks_app.models import TERMINAL_STATES, RemoteTask
from tasks_app.services import agents as agent_services
from tasks_app.services import tasks as task_services
from tasks_app.services.record import record, record_many

log = logging.getLogger(__name__)

OWNER = f"{socket.gethostname()}:{os.getpid()}"
Status = RemoteTask.WatcherStatus
INPUT_REQUIRED = "TASK_STATE_INPUT_REQUIRED"
BATCH = 500
GIVE_UP_AFTER_FAILURES = 30
LOST_HOLD_OFF_SECONDS = 600


# Celery tasks ---------------------------------------------------------------------------------


@shared_task(name="tasks_app.watchers.watch", ignore_result=True)
def watch(task_pk: int) -> str:
    """Take the lease of a task and start holding it on this process's loop."""
    token = task_services.acquire_lease(task_pk, OWNER)
    if token is None:
        return "held elsewhere"
    eventloop.submit(registry.start(task_pk, token))
    return "started"


@shared_task(name="tasks_app.watchers.reconcile", ignore_result=True)
def reconcile() -> int:
    """Dispatch a watcher for every watchable task that nobody holds (lease missing or expired)."""
    now = timezone.now()
    expired = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)
    RemoteTask.objects.filter(expired, ~Q(lease_token="")).exclude(
        watcher_status__in=[Status.IDLE, Status.LOST]
    ).update(watcher_status=Status.LOST, watcher_note="its watcher stopped answering; taking over")
    pks = list(
        RemoteTask.objects.filter(task_services.watchable())
        .filter(expired)
        .order_by("updated_at")
        .values_list("pk", flat=True)[:2000]
    )
    for pk in pks:
        watch.delay(pk)
    return len(pks)


# The per-process registry of holders ------------------------------------------------------------


class Registry:
    """Holders running on this process's loop, their lease tokens, and the heartbeat."""

    def __init__(self) -> None:
        self.holders: dict[int, tuple[Holder, asyncio.Task[None]]] = {}
        self.heartbeat: asyncio.Task[None] | None = None
        self.http: Any = None

    def tokens(self) -> dict[int, str]:
        return {pk: holder.token for pk, (holder, _) in self.holders.items()}

    async def start(self, task_pk: int, token: str) -> None:
        if self.http is None:
            self.http = outbound.new_http_client()
        if self.heartbeat is None or self.heartbeat.done():
            self.heartbeat = asyncio.get_running_loop().create_task(self._beat())
        existing = self.holders.get(task_pk)
        if existing and not existing[1].done():
            # This process already holds the task (its lease lapsed under load and was
            # taken again, here): the running holder goes on under the new token rather
            # than being interrupted, which could cut a send in half.
            existing[0].token = token
            return
        holder = Holder(task_pk, token, self.http)
        self.holders[task_pk] = (holder, asyncio.get_running_loop().create_task(self._run(holder)))

    async def _run(self, holder: Holder) -> None:
        try:
            await holder.run()
        finally:
            current = self.holders.get(holder.task_pk)
            if current and current[0] is holder:
                del self.holders[holder.task_pk]

    async def _beat(self) -> None:
        """Renew every lease we hold; cancel the holders whose lease someone else took."""
        while True:
            await asyncio.sleep(max(settings.WATCH_LEASE_SECONDS / 3, 0.2))
            held = self.tokens()
            if not held:
                continue
            try:
                kept = await eventloop.db_lease(task_services.renew_leases, set(held.values()))
            except Exception:
                log.exception("lease renewal failed")
                continue
            for pk, token in held.items():
                entry = self.holders.get(pk)
                # (A holder given a new token meanwhile is checked on the next beat.)
                if entry and entry[0].token == token and token not in kept:
                    log.warning("lost the lease of task %s; stopping its holder", pk)
                    entry[1].cancel()

    async def shutdown(self) -> None:
        """Stop every holder and give its lease back, so another worker takes over at once."""
        held = list(self.holders.items())
        for _, (_, task) in held:
            task.cancel()
        await asyncio.gather(*(task for _, (_, task) in held), return_exceptions=True)
        for pk, (holder, _) in held:
            await eventloop.db(
                task_services.release_lease,
                pk,
                holder.token,
                status=Status.IDLE,
                note="worker stopped; waiting for another",
            )
        if self.http is not None:
            await self.http.aclose()
            self.http = None


registry = Registry()


@worker_shutting_down.connect
def _on_worker_shutdown(**_: Any) -> None:
    if not eventloop.running():
        return
    try:
        eventloop.submit(registry.shutdown()).result(timeout=15)
    except Exception:
        log.exception("watchers did not shut down cleanly")
    eventloop.stop()


# One holder -------------------------------------------------------------------------------------


class HandOver(Exception):
    """The slice is over: release the lease and dispatch the continuation."""


@dataclass
class Turn:
    """Why a holder stops holding."""

    status: str
    note: str
    hold_off: float = 0
    continue_elsewhere: bool = False


class Holder:
    def __init__(self, task_pk: int, token: str, http: Any) -> None:
        self.task_pk = task_pk
        self.token = token
        self.http = http
        self.state = ""
        self.remote_id = ""
        self.agent_id = 0
        self.failures = 0
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + settings.WATCH_SLICE_SECONDS

    # -- the outline
    async def run(self) -> None:
        try:
            turn = await self._hold()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or an unforeseen answer must not kill the worker
            log.exception("watcher of task %s failed", self.task_pk)
            await self._note_problem(f"watcher error: {type(exc).__name__}: {exc}")
            turn = Turn(Status.LOST, f"watcher error: {exc}", hold_off=30)
        released = await eventloop.db(
            task_services.release_lease,
            self.task_pk,
            self.token,
            status=turn.status,
            note=turn.note,
            hold_off=turn.hold_off,
        )
        if released and turn.continue_elsewhere:
            await eventloop.db(task_services.dispatch, self.task_pk)

    async def _hold(self) -> Turn:
        task = await eventloop.db(
            lambda: RemoteTask.objects.select_related("agent").filter(pk=self.task_pk).first()
        )
        if task is None:
            return Turn(Status.IDLE, "task deleted")
        self.state, self.remote_id, self.agent_id = task.state, task.remote_id, task.agent_id
        client = outbound.client_for(
            task.agent,
            self.http,
            stream_idle_timeout=settings.WATCH_STREAM_IDLE_SECONDS,
            max_event_bytes=settings.WATCH_MAX_EVENT_BYTES,
        )
        streaming = task.agent.streaming and task.watch == RemoteTask.Watch.STREAM
        try:
            if task.outbox:
                turn = await self._send(task, client, streaming)
                if turn is not None:
                    return turn
            return await self._follow(client, streaming, task.agent_id)
        except HandOver:
            return Turn(Status.STREAMING if streaming else Status.POLLING, "handing over", continue_elsewhere=True)

    def _ended(self) -> Turn | None:
        if self.state in TERMINAL_STATES:
            return Turn(Status.IDLE, "task ended")
        if self.state == INPUT_REQUIRED:
            return Turn(Status.IDLE, "waiting for an answer")
        return None

    # -- 1. sending
    async def _send(self, task: RemoteTask, client: A2AClient, streaming: bool) -> Turn | None:
        outbox = task.outbox or {}
        message = outbox.get("message") or {}
        message_id = message.get("messageId", "")
        is_first = task.phase == RemoteTask.Phase.SENDING
        if task.send_attempted_at is not None and is_first:
            reason = (
                "the worker stopped while sending, before the agent named a task; "
                "not sent again (it may exist on the agent). Retry sends the same messageId."
            )
            await eventloop.db(task_services.fail_send, self.task_pk, reason)
            return Turn(Status.IDLE, "send interrupted")
        if not await eventloop.db(task_services.mark_send_attempted, self.task_pk, self.token):
            raise asyncio.CancelledError  # the lease is no longer ours: someone else sends
        metadata = outbox.get("metadata") or None
        try:
            if streaming:
                await self._status(Status.STREAMING)
                events = client.send_streaming_message(message, metadata=metadata)
                await self._pump(events, "stream", "stream", clear_outbox=message_id)
                return None  # step 2 checks how the stream ended
            immediately = task.mode != RemoteTask.Mode.BLOCKING or not is_first
            reply = await client.send_message(message, return_immediately=immediately, metadata=metadata)
            await eventloop.db(task_services.clear_outbox, self.task_pk, message_id)
            result = await eventloop.db(record, self.task_pk, reply.raw, "send-response")
            self.state = result.state
            await eventloop.db(agent_services.mark_reachable, task.agent_id)
            return None
        except A2AError as exc:
            if isinstance(exc, ConnectError):
                await eventloop.db(agent_services.mark_unreachable, task.agent_id, str(exc))
            refreshed = await eventloop.db(lambda: RemoteTask.objects.filter(pk=self.task_pk).first())
            if refreshed is not None and refreshed.phase == RemoteTask.Phase.SENDING:
                await eventloop.db(task_services.fail_send, self.task_pk, str(exc))
                return Turn(Status.IDLE, "send failed")
            if refreshed is not None and refreshed.phase == RemoteTask.Phase.MESSAGE:
                return Turn(Status.IDLE, "answered with a message")
            if refreshed is not None and refreshed.outbox:
                # An answer the agent refused (or never got): say so; a person may answer again.
                await eventloop.db(task_services.clear_outbox, self.task_pk, message_id)
                await self._system("answer-failed", str(exc))
            else:
                # The stream broke after the agent named the task: log why, back off, resubscribe.
                self.failures = 1
                if isinstance(exc, TransportError):
                    await self._system("stream-dropped", str(exc))
                elif isinstance(exc, ProtocolError):
                    await self._note_problem(str(exc))
                else:
                    await self._system("agent-error", str(exc))
            self.state = refreshed.state if refreshed else self.state
            self.remote_id = refreshed.remote_id if refreshed else self.remote_id
            return None

    # -- 2. following a known task
    async def _follow(self, client: A2AClient, streaming: bool, agent_id: int) -> Turn:
        refreshed = await eventloop.db(lambda: RemoteTask.objects.filter(pk=self.task_pk).first())
        if refreshed is None:
            return Turn(Status.IDLE, "task deleted")
        self.state, self.remote_id = refreshed.state, refreshed.remote_id
        if refreshed.phase == RemoteTask.Phase.MESSAGE:
            return Turn(Status.IDLE, "answered with a message; no task")
        if refreshed.phase != RemoteTask.Phase.TASK or not self.remote_id:
            return Turn(Status.IDLE, "no task to follow")
        interval = settings.WATCH_POLL_MIN_SECONDS
        if self.failures:
            await self._sleep(backoff(self.failures))
        while True:
            ended = self._ended()
            if ended is not None:
                return ended
            self._check_slice()
            try:
                if streaming:
                    await self._status(Status.RECONNECTING if self.failures else Status.STREAMING)
                    try:
                        await self._pump(client.subscribe_to_task(self.remote_id), "resubscribe", "stream")
                    except (UnsupportedOperationError, InvalidParamsError) as exc:
                        # Terminal task (or a server's variant of saying so): GetTask decides.
                        await self._poll_once(client)
                        if self._ended() is None:
                            await self._system("subscribe-refused", f"{exc}; polling instead")
                            streaming = False
                        continue
                    if self._ended() is None:
                        # A stream that closed while the task goes on proves nothing:
                        # GetTask, and say so if it shows what the stream did not.
                        await self._poll_once(client, gap_check=True)
                    self.failures = 0
                else:
                    await self._status(Status.POLLING)
                    changed = await self._poll_once(client)
                    self.failures = 0
                    max_interval = settings.WATCH_POLL_MAX_SECONDS
                    interval = settings.WATCH_POLL_MIN_SECONDS if changed else min(interval * 2, max_interval)
                    if self._ended() is None:
                        await self._sleep(interval * random.uniform(0.8, 1.0))
                await eventloop.db(agent_services.mark_reachable, agent_id)
            except TaskNotFoundError as exc:
                await self._system("task-not-found", str(exc))
                return Turn(Status.LOST, "the agent no longer knows this task", hold_off=LOST_HOLD_OFF_SECONDS)
            except TransportError as exc:
                self.failures += 1
                if self.failures == 1:  # the first of a series, not every retry
                    await self._system("stream-dropped" if streaming else "poll-failed", str(exc))
                if isinstance(exc, ConnectError):
                    await eventloop.db(agent_services.mark_unreachable, agent_id, str(exc))
                await self._status(Status.RECONNECTING, f"{exc} (attempt {self.failures})")
            except ProtocolError as exc:
                self.failures += 1
                await self._note_problem(str(exc))
            except RemoteError as exc:
                self.failures += 1
                await self._system("agent-error", str(exc))
            if self.failures >= GIVE_UP_AFTER_FAILURES:
                return Turn(Status.LOST, f"gave up after {self.failures} failures", hold_off=LOST_HOLD_OFF_SECONDS)
            if self.failures:
                await self._sleep(backoff(self.failures))

    async def _poll_once(self, client: A2AClient, *, gap_check: bool = False) -> bool:
        snapshot = await client.get_task(self.remote_id)
        result = await eventloop.db(record, self.task_pk, {"task": snapshot}, "poll", gap_check=gap_check)
        self.state = result.state
        return not result.duplicate

    # -- streams into record_many, in batches
    async def _pump(
        self,
        events: AsyncIterator[StreamEvent],
        first_channel: str,
        channel: str,
        *,
        clear_outbox: str = "",
    ) -> None:
        """Record a stream's events until it closes, the turn ends, or the slice is over.

        A reader task queues events; this coroutine records whatever has
        queued up in one transaction, so a fast stream costs one commit per
        batch rather than per event.
        """
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        async def reader() -> None:
            try:
                async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
                    async for event in stream:
                        await queue.put(event)
            except BaseException as exc:
                await queue.put(exc)
                return
            await queue.put(done)

        reader_task = self.loop.create_task(reader())
        first = True
        try:
            while True:
                timeout = self.deadline - self.loop.time()
                if timeout <= 0:
                    raise HandOver
                try:
                    item = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    raise HandOver from None
                batch = [item]
                while not queue.empty() and len(batch) < BATCH:
                    batch.append(queue.get_nowait())
                events_only = [e for e in batch if isinstance(e, StreamEvent)]
                end = next((e for e in batch if not isinstance(e, StreamEvent)), None)
                if events_only:
                    if clear_outbox:
                        await eventloop.db(task_services.clear_outbox, self.task_pk, clear_outbox)
                        clear_outbox = ""
                    if first and first_channel != channel:
                        result = await eventloop.db(record, self.task_pk, events_only[0].raw, first_channel)
                        events_only = events_only[1:]
                    if events_only:
                        result = await eventloop.db(
                            record_many, self.task_pk, [e.raw for e in events_only], channel
                        )
                    if first:
                        await self._connected()
                    first = False
                    self.state = result.state
                    if not self.remote_id:
                        self.remote_id = await eventloop.db(
                            lambda: RemoteTask.objects.filter(pk=self.task_pk).values_list("remote_id", flat=True).first() or ""
                        )
                    if self._ended() is not None:
                        return
                if isinstance(end, BaseException):
                    raise end
                if end is done:
                    return
        finally:
            reader_task.cancel()
            await asyncio.gather(reader_task, return_exceptions=True)

    # -- small helpers
    async def _connected(self) -> None:
        """A stream delivered: the agent is reachable, and a reconnection succeeded."""
        await eventloop.db(agent_services.mark_reachable, self.agent_id)
        if self.failures:
            self.failures = 0
            await self._status(Status.STREAMING)

    def _check_slice(self) -> None:
        if self.loop.time() >= self.deadline:
            raise HandOver

    async def _sleep(self, seconds: float) -> None:
        remaining = self.deadline - self.loop.time()
        if remaining <= 0:
            raise HandOver
        await asyncio.sleep(min(seconds, remaining))

    async def _status(self, status: str, note: str = "") -> None:
        held = await eventloop.db(task_services.set_watcher_status, self.task_pk, self.token, status, note)
        if not held:
            raise asyncio.CancelledError

    async def _system(self, event: str, detail: str) -> None:
        await eventloop.db(record, self.task_pk, {"system": {"event": event, "detail": detail[:2000]}}, "system")

    async def _note_problem(self, message: str) -> None:
        try:
            await eventloop.db(record, self.task_pk, {"protocolError": {"message": message[:2000]}}, "system")
        except Exception:
            log.exception("could not record a protocol error for task %s", self.task_pk)


def backoff(failures: int) -> float:
    """Exponential backoff with full jitter, capped."""
    cap = settings.WATCH_BACKOFF_MAX_SECONDS
    return random.uniform(0.5, 1.0) * min(cap, settings.WATCH_BACKOFF_BASE_SECONDS * 2 ** (failures - 1))
