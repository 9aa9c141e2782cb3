"""Watchers: hold a task's outbound stream or polling loop, and feed ``record()``.

Shape (docs/architecture.md, "Watching", has the why and the state table):

* ``watch(task_pk)`` is a Celery task. It takes the task's **lease** by
  compare-and-set and starts a :class:`Holder` on the worker process's shared
  asyncio loop (``tasks_app.eventloop``), then returns at once: hundreds of
  streams share one loop and one HTTP client, and the broker never holds a
  long-running task (so its re-delivery rules do not matter).
* One heartbeat per process renews all the leases it holds; a holder whose
  lease was lost is canceled, and every write it makes is fenced by its lease
  token (``record(..., fence=token)``), so a late holder cannot write.
* A holder works for a bounded **slice**, then releases the lease and
  dispatches its own continuation; ``reconcile()`` (celery beat) dispatches
  every watchable task whose lease expired, e.g. after a worker was killed.

The watcher is a state machine: :data:`TABLE` lists every watcher status, what
bounds the time spent in it, and the next status for each event. The holder
changes status only through :func:`next_status`, so the table is the
behaviour, not a description of it.

Backoff follows **progress**, not exceptions: a turn (one stream, or one
poll) that brings nothing new from the agent and no valid word about our task
(only protocol errors, a refused call, a dead connection) is *fruitless*. The
holder backs off with jitter after each one and, after
``WATCH_MAX_FRUITLESS_TURNS`` in a row, parks the task ("needs attention"),
with one system entry, and looks again only rarely (``PARKED_RECHECK_SECONDS``).
A turn that only confirms what the mirror holds (an equal snapshot) is
*quiet*: not fruitless, but it waits before the next one like a poll does.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

from celery import shared_task
from celery.signals import worker_ready, worker_shutting_down
from django.conf import settings
from django.db import (
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)
from django.db.models import Q
from django.utils import timezone

from tasks_app import eventloop, metrics, outbound
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
    large_body_scope,
    safejson,
)
from tasks_app.models import TERMINAL_STATES, RemoteTask, TaskEvent
from tasks_app.runtime import logs, shared_redis
from tasks_app.services import agents as agent_services
from tasks_app.services import push as push_services
from tasks_app.services import record as record_services
from tasks_app.services import tasks as task_services
from tasks_app.services.polls import POLL_HISTORY, poll_task
from tasks_app.services.record import (
    WAITING_FOR_ANSWER,
    Batch,
    Recorded,
    record,
    record_many,
)

log = logging.getLogger(__name__)

OWNER = f"{socket.gethostname()}:{os.getpid()}"
Status = RemoteTask.WatcherStatus
INPUT_REQUIRED = "TASK_STATE_INPUT_REQUIRED"
AUTH_REQUIRED = "TASK_STATE_AUTH_REQUIRED"
# After a send's deadline, this much longer before its absence at the agent is believed.
SEND_SETTLE_SECONDS = 5.0


def _send_may_land_for(task: RemoteTask) -> float:
    """Seconds until a send attempted by another holder must have ended (0: it has)."""
    if task.send_attempted_at is None:
        return 0.0
    ends = task.send_attempted_at + timedelta(
        seconds=settings.A2A_CALL_DEADLINE_SECONDS + SEND_SETTLE_SECONDS
    )
    return max(0.0, (ends - timezone.now()).total_seconds())


# What an agent answers a follow-up message for a task it cannot take it for (ended,
# unknown, or a server's variant): GetTask tells which.
FOLLOW_UP_REFUSALS = (TaskNotFoundError, UnsupportedOperationError, InvalidParamsError)
BATCH = 500
# A batch is recorded in calls of at most this many events. On SQLite the holders share one
# database thread: one flooding task's batch of 500 (about 45 ms) held every other task's
# events behind it (P9: a healthy stream's p99 beside a flood 1.7x its p99 alone). ``record``
# folds a batch split anywhere as the same entries one by one, so the log is the same.
RECORD_CALL_EVENTS = 100
# A parked task is looked at again this rarely (one call), in case the agent recovered.
PARKED_RECHECK_SECONDS = 600
# The holder's own entries that can come back every turn: rate-limited (Holder._system).
REPEATED_NOTES = frozenset({"stream-dropped", "stream-error", "poll-failed", "agent-error"})
# While a task waits for authorization, the outbox is checked this often (an answer goes at once).
OUTBOX_CHECK_SECONDS = 1.0
# A stream is read at most this far ahead of the recorder (one bigger event is still taken):
# what a batch of big chunks costs in memory is bounded, whatever the artifact's size.
STREAM_READ_AHEAD_BYTES = 4 * 1024 * 1024
# The reconciler hands unheld tasks to the workers this many to a message (``watch_batch``).
DISPATCH_BATCH = 20


# The state table -------------------------------------------------------------------------------


class Event(enum.StrEnum):
    """What can happen to a watcher; :data:`TABLE` says where each one leads."""

    FOLLOW = "turn starts"  # a holder opens a stream or polls
    PROGRESS = "progress"  # the agent said something new
    QUIET = "quiet turn"  # a valid answer that changed nothing (waits like a poll)
    FRUITLESS = "fruitless turn"  # nothing new and no valid answer: back off with jitter
    PARK = "fruitless limit or budget"  # WATCH_MAX_FRUITLESS_TURNS, or a budget ran out
    NOT_FOUND = "agent forgot the task"  # TaskNotFound for an unfinished task
    ENDED = "turn over"  # ended, waits for input, answered by a message, or the send failed
    SLICE_OVER = "slice over"  # lease released, continuation dispatched
    LEASE_EXPIRED = "lease expired"  # the holder's process stopped renewing (reconciler)
    RECHECK = "recheck fruitless"  # a parked task's one look after its hold-off found nothing
    OPERATOR_WATCH = "watch again"  # an operator asked to watch again, or a refresh found it
    ABANDON = "abandon"  # an operator gave the task up locally
    AWAIT_PUSH = "await push"  # a push-watched task was sent or polled: nothing is held
    PUSH_SILENT = "push silent"  # no notification for PUSH_SILENCE_SECONDS: poll (backing off)
    PUSH_HEARD = "push heard"  # a notification was accepted (services/push.heard)


# "streaming" or "polling", by how the task is watched.
FOLLOWING = "following"


@dataclass(frozen=True)
class StateRule:
    """One watcher status: what it means, what bounds the time in it, where each event leads."""

    meaning: str
    timeout: str
    on: dict[Event, str] = field(default_factory=dict)


def _active(**overrides: str) -> dict[Event, str]:
    exits = {
        Event.FOLLOW: FOLLOWING,
        Event.PROGRESS: FOLLOWING,
        Event.QUIET: FOLLOWING,
        Event.FRUITLESS: Status.RECONNECTING,
        Event.PARK: Status.PARKED,
        Event.NOT_FOUND: Status.GONE,
        Event.ENDED: Status.IDLE,
        Event.SLICE_OVER: Status.IDLE,
        Event.LEASE_EXPIRED: Status.LOST,
        Event.RECHECK: Status.PARKED,
        Event.OPERATOR_WATCH: Status.IDLE,
        Event.ABANDON: Status.ABANDONED,
        Event.AWAIT_PUSH: Status.AWAITING_PUSH,
        Event.PUSH_SILENT: Status.POLLING,
        Event.PUSH_HEARD: Status.AWAITING_PUSH,
    }
    exits.update({Event[key]: value for key, value in overrides.items()})
    return exits


TABLE: dict[str, StateRule] = {
    Status.IDLE: StateRule(
        "nobody holds the task: it ended, waits for an answer, or waits for a worker",
        "RECONCILE_EVERY_SECONDS: the reconciler dispatches every watchable task nobody holds "
        "(a task waiting for an answer: after WATCH_QUESTION_RECHECK_SECONDS, for one GetTask)",
        _active(),
    ),
    Status.STREAMING: StateRule(
        "a stream (the send's, or SubscribeToTask) is open",
        "the slice (WATCH_SLICE_SECONDS); a silent stream fails after WATCH_STREAM_IDLE_SECONDS",
        _active(),
    ),
    Status.POLLING: StateRule(
        "GetTask every WATCH_POLL_MIN..MAX_SECONDS (slower while nothing changes)",
        "the slice (WATCH_SLICE_SECONDS); every call has its deadline",
        _active(),
    ),
    Status.RECONNECTING: StateRule(
        "the last turns were fruitless (the note says why); backing off with jitter",
        "the backoff (at most WATCH_BACKOFF_MAX_SECONDS), then one more turn; "
        "parked after WATCH_MAX_FRUITLESS_TURNS in a row",
        _active(FOLLOW=Status.RECONNECTING),
    ),
    Status.AWAITING_PUSH: StateRule(
        "followed by push notifications: nobody holds a connection; each notification is "
        "recorded, then checked with GetTask",
        "PUSH_SILENCE_SECONDS without a notification: the reconciler hands the task to a "
        "watcher, which polls it (push silent -> polling). An operator can switch to "
        "streaming or polling, refresh, cancel or abandon at any time",
        _active(SLICE_OVER=Status.AWAITING_PUSH),
    ),
    Status.LOST: StateRule(
        "the holder's worker stopped renewing its lease",
        "WATCH_LEASE_SECONDS plus a reconcile tick: the reconciler dispatches a new holder",
        _active(),
    ),
    Status.PARKED: StateRule(
        "needs attention: fruitless turns, or a budget ran out (the note says which)",
        "PARKED_RECHECK_SECONDS, then one turn: news resumes watching, nothing parks it again "
        "silently. An operator can watch again, refresh, cancel or abandon at any time",
        _active(
            FOLLOW=Status.PARKED,
            FRUITLESS=Status.PARKED,
            SLICE_OVER=Status.PARKED,
            LEASE_EXPIRED=Status.PARKED,
            AWAIT_PUSH=Status.PARKED,
            PUSH_SILENT=Status.PARKED,
            PUSH_HEARD=Status.PARKED,
        ),
    ),
    Status.GONE: StateRule(
        "the agent answered TaskNotFound for a task it had not finished",
        "none: not watched any more. A refresh that finds the task again resumes watching; "
        "abandon ends it locally",
        {
            Event.OPERATOR_WATCH: Status.IDLE,
            Event.ABANDON: Status.ABANDONED,
            Event.ENDED: Status.GONE,
        },
    ),
    Status.ABANDONED: StateRule(
        "an operator gave the task up locally (who and why are in the log)",
        "final: a local end state, never watched again",
        {Event.ENDED: Status.ABANDONED},
    ),
}


def next_status(current: str, event: Event, *, streaming: bool = False) -> str:
    """The table's next status; an event the table does not list keeps the status (and says so)."""
    rule = TABLE.get(current) or TABLE[Status.IDLE]
    target = rule.on.get(event)
    if target is None:
        log.warning("watcher table: no transition from %s on %s; status kept", current, event.value)
        return current
    if target == FOLLOWING:
        return Status.STREAMING if streaming else Status.POLLING
    return target


# The database unreachable (restarting, the network): no agent's fault, so no fruitless turn.
DATABASE_DOWN = (OperationalError, InterfaceError)
# How often a process says so, however many holders meet it (a thousand streams at once).
DATABASE_DOWN_LOG_SECONDS = 10.0
_database_down_logged = [0.0, 0]  # when it was last said; holders that met it since


def _database_down(exc: Exception) -> None:
    """One warning per ``DATABASE_DOWN_LOG_SECONDS`` for what met the outage (holders' turns,
    lease renewals, reconcile ticks), with how many did."""
    now = time.monotonic()
    _database_down_logged[1] += 1
    if now - _database_down_logged[0] >= DATABASE_DOWN_LOG_SECONDS:
        log.warning("the database is unreachable (%s), %d time(s) since the last word: watcher "
                    "turns stop and their leases lapse; the tasks are taken up again once it "
                    "answers", type(exc).__name__, _database_down_logged[1])  # fmt: skip
        _database_down_logged[:] = [now, 0]


# Celery tasks ---------------------------------------------------------------------------------


@shared_task(name="tasks_app.watchers.watch", ignore_result=True)
def watch(task_pk: int) -> str:
    """Take the lease of a task and start holding it on this process's loop."""
    token = task_services.acquire_lease(task_pk, OWNER)
    if token is None:
        return "held elsewhere"
    eventloop.submit(registry.start(task_pk, token))
    return "started"


@shared_task(name="tasks_app.watchers.watch_batch", ignore_result=True)
def watch_batch(task_pks: list[int]) -> str:
    """``watch`` for several tasks at once: the reconciler's takeovers after a worker died.

    One message per task cost the surviving workers a broker round trip, an
    acknowledgement and two log lines per stream; a thousand orphaned streams took
    them 20-40 s to pick up (measured, P2x). A batch takes its leases in one
    transaction and starts its holders together.
    """
    tokens = task_services.acquire_leases(task_pks, OWNER)
    # Read here, in one query: a thousand holders starting at once each reading its own row
    # queued behind one another on the loop's database threads for seconds (measured, P2x).
    tasks = RemoteTask.objects.select_related("agent").in_bulk(list(tokens))
    for task_pk, token in tokens.items():
        eventloop.submit(registry.start(task_pk, token, loaded=tasks.get(task_pk)))
    return f"started {len(tokens)} of {len(task_pks)}"


@shared_task(name="tasks_app.watchers.reconcile", ignore_result=True)
def reconcile() -> int:
    """Beat's tick (see ``reconcile_once``): quiet, it runs every few seconds."""
    return reconcile_once()


def reconcile_once() -> int:
    """Run the reconcile tick unless another process ran it within this period.

    Beat sends the tick, and every worker also runs it on a timer of its own
    (``_ReconcileTimer``), so recovery needs no single beat: with two beats, or none, the
    cluster still ticks about once per ``RECONCILE_EVERY_SECONDS``. The period is claimed
    with one Redis ``SET NX PX`` (per queue, so separate deployments on one Redis do not
    share it); whoever claims it runs the tick, the others return 0. If Redis cannot be
    reached the tick runs anyway: dispatching twice is harmless (the lease is taken by
    compare-and-set), not dispatching is not.
    """
    period_ms = max(100, int(settings.RECONCILE_EVERY_SECONDS * 900))
    key = f"dashboard:reconcile:{settings.CELERY_TASK_DEFAULT_QUEUE}"
    try:
        claimed = shared_redis.client(settings.REDIS_URL).set(key, OWNER, nx=True, px=period_ms)
    except Exception:  # Redis down: tick anyway (see above)
        _claim_failures.failed()
        claimed = True
    else:
        _claim_failures.worked()
    if not claimed:
        return 0
    metrics.count("reconcile_ticks")  # about one per period however many ask: /metrics shows it
    return _reconcile()


def _reconcile() -> int:
    """Dispatch a watcher for every watchable task that nobody holds (lease missing or expired)."""
    now = timezone.now()
    expired = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)
    stale = RemoteTask.objects.filter(expired, ~Q(lease_token="")).exclude(
        watcher_status__in=[Status.IDLE, Status.LOST, Status.PARKED, Status.GONE, Status.ABANDONED]
    )
    # Both writes lock their rows in pk order first, skipping rows a renewal holds (see
    # ``locked_in_pk_order``: in scan order they deadlocked with the renewals).
    lock = partial(task_services.locked_in_pk_order, skip_locked=True)
    with transaction.atomic():
        taken_over = RemoteTask.objects.filter(
            pk__in=lock(stale.filter(task_services.watchable()))
        ).update(
            watcher_status=next_status(Status.STREAMING, Event.LEASE_EXPIRED),  # "lost"
            watcher_note="its watcher stopped answering; taking over",
            watcher_since=now,
        )
    # A holder that could not release (the database away, the worker killed) of a task with
    # nothing left to watch (ended): nobody takes it over, and it
    # said "lost" for ever. It is idle, as a release would have left it.
    with transaction.atomic():
        RemoteTask.objects.filter(
            pk__in=lock(
                stale.exclude(
                    pk__in=RemoteTask.objects.filter(task_services.watchable()).values("pk")
                )
            )
        ).update(
            watcher_status=Status.IDLE,
            watcher_note="its watcher stopped; nothing is left to watch",
            watcher_since=now,
            lease_token="",
            lease_owner="",
            lease_expires_at=None,
        )
    metrics.count("lease_takeovers", taken_over)
    pks = list(
        RemoteTask.objects.filter(task_services.watchable())
        .filter(expired)
        .order_by("updated_at")
        .values_list("pk", flat=True)[:2000]
    )
    # Small batches: few messages, yet spread over every worker that listens.
    for start in range(0, len(pks), DISPATCH_BATCH):
        watch_batch.delay(pks[start : start + DISPATCH_BATCH])
    try:
        push_services.schedule_if_waiting()  # a drain whose scheduling was lost
    except Exception:
        _push_check_failures.failed()
    else:
        _push_check_failures.worked()
    return len(pks)


# Redis (and so the broker) down: every tick failed with a traceback of 120 lines, in every
# worker, every period (1,245 lines a worker in 30 s). Each such failure is said once, with
# its traceback, then counted until it works again (``logs.FailureSpell``).
_claim_failures = logs.FailureSpell(
    log,
    "reconcile: could not claim the period; ticking anyway, and further failures are counted",
    "reconcile: the period is claimed again: %d claims failed over %.1f s",
)
_push_check_failures = logs.FailureSpell(
    log,
    "could not check the push queue; further failures are counted",
    "the push queue is checked again: %d checks failed over %.1f s",
)
_tick_failures = logs.FailureSpell(
    log,
    "reconcile tick failed; further failures are counted until a tick works",
    "reconcile ticks again: %d ticks failed over %.1f s",
)


# The per-process registry of holders ------------------------------------------------------------


class Registry:
    """Holders running on this process's loop, their lease tokens, and the heartbeat."""

    def __init__(self) -> None:
        self.holders: dict[int, tuple[Holder, asyncio.Task[None]]] = {}
        self.heartbeat: threading.Thread | None = None
        self.stopping = threading.Event()
        # Streams in pools of their own, every other call in others (see A2AClient), each
        # kind split into shards (see ClientShards).
        self.http: outbound.ClientShards | None = None
        self.stream_http: outbound.ClientShards | None = None

    async def start(self, task_pk: int, token: str, loaded: RemoteTask | None = None) -> None:
        if self.http is None or self.stream_http is None:
            self.http, self.stream_http = outbound.ClientShards(), outbound.ClientShards()
        self.ensure_heartbeat()
        existing = self.holders.get(task_pk)
        running = existing if existing and not existing[1].done() else None
        if running and not running[0].releasing:
            # This process already holds the task (its lease lapsed under load and was
            # taken again, here): the running holder goes on under the new token rather
            # than being interrupted, which could cut a send in half.
            running[0].token = token
            return
        # A holder that is giving its lease back (its turn is over) ends without looking
        # at the task again: the new turn (an answer's dispatch, say) starts once it has.
        holder = Holder(
            task_pk,
            token,
            self.http.for_task(task_pk),
            stream_http=self.stream_http.for_task(task_pk),
            loaded=loaded,
        )
        self.holders[task_pk] = (
            holder,
            asyncio.get_running_loop().create_task(
                self._run(holder, after=running[1] if running else None)
            ),
        )

    async def _run(self, holder: Holder, after: asyncio.Task[None] | None = None) -> None:
        try:
            if after is not None:
                await asyncio.gather(after, return_exceptions=True)
            await holder.run()
        finally:
            current = self.holders.get(holder.task_pk)
            if current and current[0] is holder:
                del self.holders[holder.task_pk]

    def ensure_heartbeat(self) -> None:
        if self.heartbeat is None or not self.heartbeat.is_alive():
            self.stopping = threading.Event()  # the new thread's own (a stopped one keeps its)
            self.heartbeat = threading.Thread(
                target=self._beat, args=(self.stopping,), name="watch-lease", daemon=True
            )
            self.heartbeat.start()

    def _beat(self, stopping: threading.Event) -> None:
        """Renew every lease we hold; cancel the holders whose lease someone else took.

        A thread of its own, not a coroutine on the loop: when a worker takes over a
        thousand streams at once the loop is busy for seconds, and a heartbeat waiting
        for its turn there renewed late enough that the worker lost its *own* leases too
        (measured, P2x: 600-1,800 of them, re-taken a few seconds later).
        """
        try:
            self._renew_until(stopping)
        finally:
            connection.close()  # this thread's own

    def _renew_until(self, stopping: threading.Event) -> None:
        while not stopping.wait(max(settings.WATCH_LEASE_SECONDS / 3, 0.2)):
            # A copy taken at once (the loop changes the dict); tokens as they are now.
            held = [(holder, task, holder.token) for holder, task in list(self.holders.values())]
            if not held:
                continue
            try:
                close_old_connections()
                kept = task_services.renew_leases({token: h.status for h, _, token in held})
            except DATABASE_DOWN as exc:
                _database_down(exc)  # said once per DATABASE_DOWN_LOG_SECONDS, not per beat
                connection.close()
                continue
            except Exception:
                log.exception("lease renewal failed")
                connection.close()
                continue
            for holder, task, token in held:
                if token not in kept:
                    with contextlib.suppress(RuntimeError):  # that loop has closed
                        task.get_loop().call_soon_threadsafe(
                            self._stop_if_lost, holder, task, token
                        )

    def _stop_if_lost(self, holder: Holder, task: asyncio.Task[None], token: str) -> None:
        # (A holder given a new token meanwhile is checked on the next beat.)
        if holder.token == token and not task.done():
            log.info("lost the lease of task %s; stopping its holder", holder.task_pk)
            task.cancel()

    async def shutdown(self) -> None:
        """Stop every holder and give its lease back, so another worker takes over at once."""
        self.stopping.set()
        self.heartbeat = None
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
        for http in (self.http, self.stream_http):
            if http is not None:
                await http.aclose()
        self.http = self.stream_http = None


registry = Registry()


class _ReconcileTimer:
    """Each worker ticks the reconciler on its own timer (claimed per period in Redis), so
    stream recovery goes on when beat is down or runs twice."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None and settings.RECONCILE_IN_WORKERS:
            self.thread = threading.Thread(target=self._run, name="reconcile-timer", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(settings.RECONCILE_EVERY_SECONDS * random.uniform(1.0, 1.5)):
            try:
                reconcile_once()
            except DATABASE_DOWN as exc:
                _database_down(exc)  # the next period tries again, said once in a while
            except Exception:  # the next period tries again; the worker goes on
                _tick_failures.failed()
            else:
                _tick_failures.worked()
            finally:
                connection.close()  # this thread's connection: not kept between ticks


reconcile_timer = _ReconcileTimer()


@worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    reconcile_timer.start()


@worker_shutting_down.connect
def _on_worker_shutdown(**_: Any) -> None:
    reconcile_timer.stop.set()
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


class Fenced(Exception):
    """A write was refused because the lease moved on: stop quietly, write nothing more."""


class OutboxReady(Exception):
    """An answer waits in the outbox while the task waits for authorization: send it now."""


@dataclass
class Turn:
    """Why a holder stops holding."""

    status: str
    note: str
    hold_off: float = 0
    continue_elsewhere: bool = False
    # The turn ended because the task asks for input: an answer may be committed meanwhile.
    awaits_answer: bool = False


@dataclass
class Outcome:
    """What one turn (a stream, or a poll) brought."""

    progress: bool = False  # the agent said something new
    confirmed: bool = False  # a valid word about our task, even if nothing changed
    problem: str = ""  # why the turn was fruitless
    over_budget: bool = False
    dropped: bool = False  # the stream broke after it spoke: back off once before the next

    def add(self, result: Recorded) -> None:
        if result.fenced:
            raise Fenced
        self.progress = self.progress or result.progress
        # A refusal the log holds already is not written again, but it is the same answer.
        kinds = result.kinds or [kind for kind, _ in result.repeated]
        notes = result.notes if result.kinds else [note for _, note in result.repeated]
        if kinds and all(kind == "protocol-error" for kind in kinds):
            self.problem = self.problem or (notes[0] if notes else "protocol error")
        else:
            self.confirmed = True
        self.over_budget = self.over_budget or getattr(result, "over_budget", False)


class Holder:
    def __init__(
        self,
        task_pk: int,
        token: str,
        http: Any,
        *,
        stream_http: Any = None,
        loaded: RemoteTask | None = None,
    ) -> None:
        self.task_pk = task_pk
        self.token = token
        self.http = http
        self.stream_http = stream_http
        self.loaded = loaded  # the row as read right after the lease was taken, if it was
        self.state = ""
        self.remote_id = ""
        self.sent_here = False  # this holder made the send (see _recover_send)
        self.agent_id = 0
        self.status = Status.IDLE
        self.fruitless = 0
        self.was_parked = False
        self.streaming = False
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + settings.WATCH_SLICE_SECONDS
        # Events-per-second budget: the loop time until which recorded events are "paid for".
        self.paid_until = self.loop.time()
        self.throttled = False
        # The history window of this holder's next poll (see services/polls.py).
        self.poll_length = POLL_HISTORY
        # Set once the turn is over and the lease is being given back (see Registry.start).
        self.releasing = False
        # Streams in a row that broke soon after bringing news (see _after_drop).
        self.drops = 0
        # Per kind of repeated note: when it was last logged, and how many since (see _system).
        self.notes: dict[str, tuple[float, int]] = {}

    # -- the outline
    async def run(self) -> None:
        logs.bind(task=self.task_pk)  # this holder's own context: its log lines name the task
        try:
            turn = await self._hold()
        except asyncio.CancelledError:
            raise
        except Fenced:
            return  # the lease moved on: the new holder speaks for the task
        except DATABASE_DOWN as exc:
            _database_down(exc)
            return  # not the agent's fault: the lease lapses, a new holder follows it later
        except A2AError as exc:  # agent misbehaviour that escaped a turn: recorded, no traceback
            turn = await self._failed(f"watcher stopped: {exc}")
        except Exception as exc:  # a bug must not kill the worker
            log.exception("watcher of task %s failed", self.task_pk)
            turn = await self._failed(f"watcher error: {type(exc).__name__}: {exc}")
        log.debug("turn ended: %s (%s)", turn.status, turn.note)
        await self._held_notes()
        self.releasing = True  # from here on this holder never looks at the task again
        try:
            released = await eventloop.db(
                task_services.release_lease,
                self.task_pk,
                self.token,
                status=turn.status,
                note=turn.note,
                hold_off=turn.hold_off,
                # Unknown until the task was read: the stored count is kept.
                fruitless_turns=self.fruitless if self.agent_id else None,
            )
        except DATABASE_DOWN as exc:
            _database_down(exc)
            return  # the lease lapses instead
        if released and (
            turn.continue_elsewhere
            # An answer committed while this turn was ending found the lease still held (its
            # dispatch said "held elsewhere"): it goes on now rather than at the next
            # reconcile tick. Committed after this look, its own dispatch takes the lease.
            or (turn.awaits_answer and await eventloop.db(task_services.has_outbox, self.task_pk))
        ):
            await eventloop.db(task_services.dispatch, self.task_pk)

    async def _failed(self, problem: str) -> Turn:
        """A turn that ended in an error is fruitless: the same error turn after turn parks the task.

        Such an error is the agent's input meeting a case nothing handles (or the database
        refusing it): retrying every 30 s forever, a traceback and a log row each time,
        would be a loop no operator asked for. ``WATCH_MAX_FRUITLESS_TURNS`` in a row park
        it like any fruitless series, with the error as the reason. Before the task was
        read (``agent_id`` unset) it is nobody's fault yet: retried as before.
        """
        problem = safejson.clean_text(problem)
        await self._note_problem(problem)
        if not self.agent_id:
            return Turn(Status.LOST, problem, hold_off=30)
        self.fruitless += 1
        if self._series_over():
            try:
                return await self._park_series(problem)
            except Exception:  # the parked note could not be written: park all the same
                log.exception("could not note that task %s is parked", self.task_pk)
                return Turn(
                    Status.PARKED,
                    f"needs attention: {problem}"[:500],
                    hold_off=PARKED_RECHECK_SECONDS,
                )
        return Turn(
            next_status(self.status, Event.FRUITLESS),
            f"{problem} (fruitless turn {self.fruitless})"[:500],
            hold_off=max(30.0, backoff(self.fruitless)),
        )

    def _take(self, task: RemoteTask) -> None:
        """What the turn starts from: the task's watcher status and its fruitless series."""
        self.status = task.watcher_status
        self.was_parked = task.watcher_status == Status.PARKED
        # A turn that starts on a waiting question looks at it once (``_look_at_question``);
        # one that reaches a question on the way has just heard it.
        self.question_looked_at = task.state != INPUT_REQUIRED
        self.fruitless = task.fruitless_turns
        self.agent_id = task.agent_id
        logs.bind(agent=task.agent_id)

    async def _load(self) -> RemoteTask | None:
        return await eventloop.db(
            lambda: RemoteTask.objects.select_related("agent").filter(pk=self.task_pk).first()
        )

    async def _hold(self) -> Turn:
        task, self.loaded = self.loaded or await self._load(), None
        if task is None:
            return Turn(Status.IDLE, "task deleted")
        if task.abandoned_at is not None:
            return Turn(Status.ABANDONED, task.watcher_note or "abandoned")
        self._take(task)
        try:
            client = outbound.client_for(
                task.agent,
                self.http,
                stream_http=self.stream_http,
                stream_idle_timeout=settings.WATCH_STREAM_IDLE_SECONDS,
                # Keep-alives keep a quiet healthy stream open until the slice ends (a quiet
                # task is not resubscribed every minute, which would turn its news into gaps);
                # a stream that never completes an event is still cut at the slice's end.
                stream_event_gap=settings.WATCH_SLICE_SECONDS,
                max_event_bytes=settings.WATCH_MAX_EVENT_BYTES,
            )
        except outbound.CredentialsWithheld as exc:
            # Only a person can fix the key or approve the origin: park (one entry), no retry loop.
            return await self._park(str(exc))
        self.streaming = task.agent.streaming and task.watch == RemoteTask.Watch.STREAM
        interval = settings.WATCH_POLL_MIN_SECONDS
        try:
            while True:
                if task is None:
                    return Turn(Status.IDLE, "task deleted")
                if task.abandoned_at is not None:
                    return Turn(Status.ABANDONED, task.watcher_note or "abandoned")
                self.state, self.remote_id = task.state, task.remote_id
                if task.outbox:
                    try:
                        turn = await self._send(task, client)
                    except OutboxReady:  # an answer came while the send's stream waited for auth
                        turn = None
                    if turn is not None:
                        return turn
                    task = await self._load()
                    continue
                if not self.question_looked_at and task.state == INPUT_REQUIRED:
                    self.question_looked_at = True
                    try:
                        await self._look_at_question(client, task)
                    except TaskNotFoundError as exc:
                        return await self._gone(str(exc))
                    task = await self._load()
                    continue
                ended = await self._ended(task, client)
                if ended is not None:
                    return ended
                if task.gone_at is not None:
                    return Turn(Status.GONE, "gone at the agent")
                if task.watch == RemoteTask.Watch.PUSH:
                    return await self._await_push(client)
                self._check_slice()
                started = self.loop.time()
                try:
                    outcome = await self._follow_turn(client)
                except TaskNotFoundError as exc:
                    return await self._gone(str(exc))
                except OutboxReady:
                    task = await self._load()
                    continue
                turn = await self._judge(outcome)
                if turn is not None:
                    return turn
                if outcome.progress and outcome.dropped:
                    interval = settings.WATCH_POLL_MIN_SECONDS
                    wait = self._after_drop(started)
                elif outcome.progress:
                    # Even a stream that brought news and closed is not reopened at once.
                    interval = wait = settings.WATCH_POLL_MIN_SECONDS
                    self.drops = 0
                elif outcome.confirmed:
                    # Quiet: nothing changed. A stream that closed on a task that goes on is
                    # not reopened at once; polls slow down while nothing changes.
                    self.drops = 0
                    interval = min(interval * 2, settings.WATCH_POLL_MAX_SECONDS)
                    wait = interval * random.uniform(0.8, 1.0)
                else:
                    wait = backoff(self.fruitless)
                if self.state not in TERMINAL_STATES and self.state != INPUT_REQUIRED and wait:
                    await self._sleep(wait)
                task = await self._load()
        except HandOver:
            status = next_status(self.status, Event.SLICE_OVER, streaming=self.streaming)
            if status == Status.PARKED:  # a parked task's one look took the whole slice
                return Turn(
                    status, "needs attention (looked again)", hold_off=PARKED_RECHECK_SECONDS
                )
            return Turn(status, "handing over", continue_elsewhere=True)

    async def _ended(self, task: RemoteTask, client: A2AClient) -> Turn | None:
        """The turn is over when the task ended, waits for input, or never became a task."""
        if task.phase == RemoteTask.Phase.MESSAGE:
            return Turn(next_status(self.status, Event.ENDED), "answered with a message; no task")
        if task.phase == RemoteTask.Phase.FAILED:
            return Turn(next_status(self.status, Event.ENDED), "send failed")
        if task.phase == RemoteTask.Phase.SENDING:
            # Nothing to send and no task named: a send interrupted before the agent answered
            # (this holder's own, whose call is over, or another's, which may still land).
            refused = await eventloop.db(task_services.refused_reply, self.task_pk)
            return await self._recover_send(
                client,
                task,
                f"the agent answered with no task this dashboard could take ({refused})"
                if refused
                else "the send was interrupted before the agent answered",
                own=self.sent_here,
            )
        if task.state in TERMINAL_STATES:
            if task.settled_at is None:
                await self._settle(client)
            return Turn(next_status(self.status, Event.ENDED), "task ended")
        if task.state == INPUT_REQUIRED:
            return Turn(
                next_status(self.status, Event.ENDED),
                WAITING_FOR_ANSWER,
                awaits_answer=True,
                # The next look at the question (an answer clears the hold-off).
                hold_off=settings.WATCH_QUESTION_RECHECK_SECONDS,
            )
        if not task.remote_id:
            return Turn(next_status(self.status, Event.ENDED), "no task to follow")
        return None

    async def _look_at_question(self, client: A2AClient, task: RemoteTask) -> None:
        """A question has waited since the last look: one GetTask says whether the agent still
        waits. It may have ended the task (timed out, canceled elsewhere) or gone on, with no
        word on a channel we hold; what differs is recorded as a poll that missed it (a gap).
        An agent that cannot be asked leaves the question as it is, until the next look.
        """
        if not task.remote_id or task.gone_at is not None:
            return
        try:
            async with eventloop.later(f"agent-{self.agent_id}"):
                await self._poll_once(client, gap_check=True)
        except TaskNotFoundError:
            raise
        except TransportError as exc:
            await self._system("poll-failed", f"looking at the waiting question again: {exc}")
            if isinstance(exc, ConnectError):
                await eventloop.db(agent_services.mark_unreachable, self.agent_id, str(exc))
        except ProtocolError as exc:
            await self._note_problem(str(exc))
        except RemoteError as exc:
            await eventloop.db(agent_services.mark_reachable, self.agent_id)
            await self._system("agent-error", f"looking at the waiting question again: {exc}")

    async def _settle(self, client: A2AClient) -> None:
        """A terminal state was seen: GetTask once, and let the mirror settle on it."""
        snapshot: dict | None = None
        note = ""
        # A few at a time (see eventloop.later): the GetTasks per agent, so that a slow
        # agent stalls only its own tasks' settling; the folds in the gate all share. A large
        # reply keeps its slot until it is recorded (see a2a.large_body_scope).
        async with large_body_scope():
            try:
                async with eventloop.later(f"agent-{self.agent_id}"):
                    snapshot = await client.get_task(self.remote_id)
                    await eventloop.db(agent_services.mark_reachable, self.agent_id)
            except A2AError as exc:
                note = f"GetTask after the end failed: {exc}"
            async with eventloop.later():
                result = await eventloop.db(
                    record_services.settle, self.task_pk, snapshot, fence=self.token, note=note
                )
        if result.fenced:
            raise Fenced
        async with eventloop.later(f"agent-{self.agent_id}"):
            await push_services.forget_configs(
                client, self.task_pk, "deleted when the task settled"
            )

    # -- push: nothing held; poll only when the notifications fall silent
    async def _await_push(self, client: A2AClient) -> Turn:
        """Release the task for PUSH_SILENCE_SECONDS, or poll it once if it has been silent that long.

        Each accepted notification moves the hold-off forward (``push.heard``), so a
        task whose agent keeps notifying is never polled. A silent one is polled, and
        looked at again after half the silence so far (between WATCH_POLL_MIN_SECONDS
        and PUSH_POLL_MAX_SECONDS): the longer the silence, the rarer the polls.
        """
        quiet = await eventloop.db(push_services.silence, self.task_pk)
        limit = settings.PUSH_SILENCE_SECONDS
        if quiet < limit:
            return Turn(
                next_status(self.status, Event.AWAIT_PUSH),
                "awaiting push notifications",
                hold_off=limit - quiet,
            )
        await self._go(Event.PUSH_SILENT, f"no push notification for {quiet:.0f} s; polling")
        try:
            outcome = await self._follow_turn(client)
        except TaskNotFoundError as exc:  # as a polled task: gone, not a stopped watcher
            return await self._gone(str(exc))
        turn = await self._judge(outcome)
        if turn is not None:
            return turn
        task = await self._load()
        if task is not None:
            ended = await self._ended(task, client)
            if ended is not None:
                return ended
        wait = min(max(quiet / 2, settings.WATCH_POLL_MIN_SECONDS), settings.PUSH_POLL_MAX_SECONDS)
        return Turn(
            self.status,
            f"no push notification for {quiet:.0f} s: polling every {wait:.0f} s until one arrives",
            hold_off=wait,
        )

    # -- judging a turn: progress, quiet, or fruitless
    async def _judge(self, outcome: Outcome) -> Turn | None:
        # record() said so in the log, once. An end is kept past the budget
        # (``_Fold._end_over_budget``): an ended task is settled, not parked.
        if outcome.over_budget and self.state not in TERMINAL_STATES:
            return await self._park(
                f"the task is over its storage budget ({settings.BUDGET_TASK_BYTES} bytes of agent content)",
                announce=False,
            )
        if outcome.progress or (outcome.confirmed and not outcome.problem):
            await self._series_ends()
            await self._go(Event.PROGRESS if outcome.progress else Event.QUIET)
            return None
        self.fruitless += 1
        await eventloop.db(task_services.set_fruitless, self.task_pk, self.token, self.fruitless)
        reason = outcome.problem or "nothing new"
        if self._series_over():
            return await self._park_series(reason)
        if outcome.problem and await self._agent_over_error_budget():
            return await self._park(
                f"the agent sent more than {settings.BUDGET_AGENT_PROTOCOL_ERRORS_PER_MINUTE} "
                f"protocol errors in a minute; last: {reason}"
            )
        await self._go(Event.FRUITLESS, f"{reason} (fruitless turn {self.fruitless})")
        return None

    async def _series_ends(self) -> None:
        """A useful answer ends a fruitless series (and a parked task's parking) at once."""
        if not (self.fruitless or self.was_parked):
            return
        self.fruitless = 0
        await eventloop.db(task_services.set_fruitless, self.task_pk, self.token, 0)
        if self.was_parked:
            self.was_parked = False
            await self._system("watching-again", "the agent answered usefully again")

    async def _agent_over_error_budget(self) -> bool:
        budget = settings.BUDGET_AGENT_PROTOCOL_ERRORS_PER_MINUTE
        since = timezone.now() - timedelta(seconds=60)

        def count() -> int:
            return TaskEvent.objects.filter(
                task__agent_id=self.agent_id, kind="protocol-error", received_at__gte=since
            )[: budget + 1].count()

        return budget > 0 and await eventloop.db(count) > budget

    def _series_over(self) -> bool:
        """Whether the fruitless series (just counted) parks the task: it reached the limit,
        or this was a parked task's one look."""
        return self.was_parked or self.fruitless >= settings.WATCH_MAX_FRUITLESS_TURNS

    async def _park_series(self, last: str) -> Turn:
        return await self._park(f"{self.fruitless} fruitless turns in a row; last: {last}")

    async def _park(self, reason: str, *, announce: bool = True) -> Turn:
        """Needs attention: one system entry (not one per turn), then a long hold-off."""
        if announce and not self.was_parked:
            await self._system("parked", reason)
        status = next_status(self.status, Event.PARK if not self.was_parked else Event.RECHECK)
        return Turn(status, f"needs attention: {reason}"[:500], hold_off=PARKED_RECHECK_SECONDS)

    async def _gone(self, detail: str) -> Turn:
        """The agent no longer knows an unfinished task: say so once, stop watching."""
        await eventloop.db(agent_services.mark_reachable, self.agent_id)  # it did answer
        await eventloop.db(task_services.mark_gone, self.task_pk, self.token, detail)
        return Turn(next_status(self.status, Event.NOT_FOUND), "gone at the agent")

    # -- 1. sending
    async def _send(self, task: RemoteTask, client: A2AClient) -> Turn | None:
        outbox = task.outbox or {}
        message = outbox.get("message") or {}
        message_id = message.get("messageId", "")
        is_first = task.phase == RemoteTask.Phase.SENDING
        if task.send_attempted_at is not None and is_first:
            return await self._recover_send(
                client, task, "the worker stopped while sending, before the agent answered"
            )
        if task.send_attempted_at is not None:
            # This answer was sent before and its acknowledgement never saved.
            try:
                if await self._answer_arrived(client, task, message_id):
                    return None
            except TaskNotFoundError as exc:
                return await self._gone(str(exc))
        push_config = None
        if is_first and task.watch == RemoteTask.Watch.PUSH:
            # Before the send is marked attempted: a config that cannot be made or read
            # leaves a send that never started, not one to look for at the agent.
            try:
                push_config = await eventloop.db(push_services.config_for_send, self.task_pk)
            except outbound.CredentialsWithheld as exc:
                return await self._park(str(exc))
            if push_config is None:
                await self._push_refused("PUBLIC_URL is not set where the watcher runs")
        attempted = await eventloop.db(
            task_services.mark_send_attempted, self.task_pk, self.token, message_id
        )
        if attempted is None:
            raise Fenced  # the lease is no longer ours: someone else sends
        if not attempted:
            return None  # withdrawn meanwhile (canceled before it was sent): read it again
        self.sent_here = True  # this holder's call: when it is over, it is over
        metadata = outbox.get("metadata") or None
        try:
            if self.streaming:
                await self._go(Event.FOLLOW)
                events = client.send_streaming_message(message, metadata=metadata)
                outcome = await self._pump(events, "stream", "stream", clear_outbox=message_id)
                if await eventloop.db(task_services.has_outbox, self.task_pk):
                    # The agent took the request and closed the stream without a word: never
                    # send it again blindly (a first send is looked up by its contextId next;
                    # an answer's question is open again for a person to answer).
                    if is_first:
                        await eventloop.db(task_services.clear_outbox, self.task_pk, message_id)
                    else:
                        await eventloop.db(task_services.answer_failed, self.task_pk, message_id)
                        await self._system(
                            "answer-failed",
                            "the agent closed the stream without any event; the question is "
                            "open again",
                        )
                if outcome.over_budget and self.state not in TERMINAL_STATES:  # as in _judge
                    return await self._park("the task is over its storage budget", announce=False)
                if outcome.dropped and self.state not in TERMINAL_STATES:
                    await self._sleep(backoff(1))
                return None  # the loop checks how the stream ended
            # Blocking starts are sent as return-immediately and followed: the task is named
            # at once, so it can be canceled, and a long task never holds a request open.
            reply = await client.send_message(
                message, return_immediately=True, metadata=metadata, push_config=push_config
            )
            await eventloop.db(agent_services.mark_reachable, task.agent_id)
            await eventloop.db(task_services.clear_outbox, self.task_pk, message_id)
            result = await eventloop.db(
                record, self.task_pk, reply.raw, "send-response", fence=self.token
            )
            if result.fenced:
                raise Fenced
            self.state = result.state
            if push_config is not None and reply.kind == "task":
                problem = await push_services.ensure_registered(
                    client, self.task_pk, reply.task_id or "", push_config
                )
                if problem:
                    await self._push_refused(problem)
            return None
        except A2AError as exc:
            if isinstance(exc, ConnectError):
                await eventloop.db(agent_services.mark_unreachable, task.agent_id, str(exc))
            elif isinstance(exc, RemoteError):
                await eventloop.db(agent_services.mark_reachable, task.agent_id)
            refreshed = await self._load()
            if refreshed is None:
                return Turn(Status.IDLE, "task deleted")
            if refreshed.phase == RemoteTask.Phase.SENDING:
                if isinstance(exc, ConnectError):
                    # Nothing reached the agent: the send failed, and a retry is safe.
                    await eventloop.db(
                        task_services.fail_send,
                        self.task_pk,
                        str(exc),
                        retry_safe=True,
                        fence=self.token,
                    )
                    return Turn(next_status(self.status, Event.ENDED), "send failed")
                hint = getattr(exc, "snippet", "") or ""
                refused = task_services.refuses_our_context(exc, message)
                return await self._recover_send(
                    client, refreshed, str(exc), hint=hint, own=True, context_refused=refused
                )
            if refreshed.phase == RemoteTask.Phase.MESSAGE:
                return Turn(next_status(self.status, Event.ENDED), "answered with a message")
            if refreshed.outbox:
                # An answer the agent refused (or never got): say so, and open the question
                # again, so that a person may answer again. Refused as not found, not
                # supported or invalid, the task may have ended meanwhile (timed out,
                # canceled elsewhere): GetTask decides (the A2A reference's rule).
                after = "the question is open again"
                if refreshed.remote_id and isinstance(exc, FOLLOW_UP_REFUSALS):
                    self.remote_id = refreshed.remote_id
                    try:
                        await self._poll_once(client)
                    except TaskNotFoundError as gone:
                        await eventloop.db(task_services.answer_failed, self.task_pk, message_id)
                        await self._system("answer-failed", f"{exc}; the task is gone")
                        return await self._gone(str(gone))
                    except A2AError:
                        pass  # not known better: the question opens again
                    else:
                        if self.state in TERMINAL_STATES:
                            after = f"the task had ended ({self.state})"
                await eventloop.db(task_services.answer_failed, self.task_pk, message_id)
                await self._system("answer-failed", f"{exc}; {after}")
                if self.state in TERMINAL_STATES:
                    return None
            elif isinstance(exc, TransportError):
                await self._system("stream-dropped", str(exc))
            elif isinstance(exc, ProtocolError):
                await self._note_problem(str(exc))
            else:
                await self._system("agent-error", str(exc))
            self.state, self.remote_id = refreshed.state, refreshed.remote_id
            return None

    async def _answer_arrived(self, client: A2AClient, task: RemoteTask, message_id: str) -> bool:
        """Whether an answer sent before (its clearing from the outbox never saved) reached the agent.

        The worker or the database stopped between the agent taking the answer and the
        outbox being cleared. Sent again blindly, the agent would get it twice, or refuse
        it and the question would open again though it was answered. GetTask decides:

        1. our message is in the task's history: it arrived;
        2. the task no longer waits in the state, on the status message, that it waited on
           when the answer was given: it moved on, and the answer is not sent again (an
           agent that keeps no history cannot tell more; a new question is recorded as
           one, and can be answered);
        3. otherwise it still waits for this answer: False, and it is sent.

        In 1 and 2 the snapshot is recorded, the outbox cleared and a ``found-again``
        entry says which. A lookup that fails raises: the turn fails and is retried, the
        answer kept in the outbox.
        """
        snapshot = await client.get_task(self.remote_id)
        fate = answer_fate(snapshot, message_id, task.state, task.status_message)
        if fate == "waiting":
            return False
        await self._system(
            "found-again",
            "the worker stopped while sending an answer; "
            + (
                "the agent has it, so it is not sent again"
                if fate == "arrived"
                else "the task has moved on since, so it is not sent again"
            ),
        )
        result = await eventloop.db(
            record, self.task_pk, {"task": snapshot}, "poll", fence=self.token
        )
        if result.fenced:
            raise Fenced
        await eventloop.db(task_services.clear_outbox, self.task_pk, message_id)
        await eventloop.db(agent_services.mark_reachable, task.agent_id)
        self.state = result.state
        return True

    async def _recover_send(
        self,
        client: A2AClient,
        task: RemoteTask,
        reason: str,
        *,
        hint: str = "",
        own: bool = False,
        context_refused: bool = False,
    ) -> Turn | None:
        """The reply to a send was lost or unreadable: find the task before saying the send failed.

        ``context_refused``: the agent's error refused the contextId chosen here. Not found
        by it, the message goes again without one (``task_services.send_without_context``):
        the refusal says the agent took nothing, and every send to it failed alike.

        ``own``: the send was this holder's, and its call is over. Else (a holder that
        stopped while sending) the call may still be under way, its holder alive but late
        with its lease: an agent that lists no task yet is asked again once the call must
        have ended (``A2A_CALL_DEADLINE_SECONDS``), before a retry is called safe (a retry
        while the first send still lands makes a second remote task).
        """
        message = (task.request or {}).get("message") or (task.outbox or {}).get("message") or {}
        found = await task_services.find_sent_task(client, message, hint=hint)
        wait = 0.0 if own else _send_may_land_for(task)
        if found.task is None and found.absent and wait > 0:
            note = f"{reason}; not listed by the agent yet: looking again in {wait:.0f} s"
            return Turn(next_status(self.status, Event.FRUITLESS), note, hold_off=wait)
        found_id = found.task.get("id") if found.task is not None else None
        mirrored = (
            await eventloop.db(
                record_services.mirrored_elsewhere, task.agent_id, found_id, self.task_pk
            )
            if isinstance(found_id, str) and found_id
            else None
        )
        if mirrored is not None:
            # An agent that gives one task id to several sends: recorded, the task was refused
            # (another row mirrors it), no id was taken, and the holder went on following a
            # task with no id (SubscribeToTask with an empty id until it was parked).
            await eventloop.db(
                task_services.fail_send,
                self.task_pk,
                f"{reason}; the agent's task for this message, {found_id!r}, is the task "
                f"#{mirrored} mirrors already (the agent gave one task to two sends)",
                retry_safe=False,
                fence=self.token,
            )
            return Turn(next_status(self.status, Event.ENDED), "send failed")
        if found.task is not None:
            await self._system(
                "found-again",
                f"{reason}; found the task {found.task.get('id')!r} by the contextId this dashboard chose",
            )
            result = await eventloop.db(
                record, self.task_pk, {"task": found.task}, "poll", fence=self.token
            )
            if result.fenced:
                raise Fenced
            await eventloop.db(
                task_services.clear_outbox, self.task_pk, message.get("messageId", "")
            )
            await eventloop.db(agent_services.mark_reachable, task.agent_id)
            self.state = result.state
            return None
        if context_refused and await eventloop.db(
            task_services.send_without_context, self.task_pk, self.token, message, reason
        ):
            return None  # read again: the outbox holds the message without a contextId
        if found.absent:
            await eventloop.db(
                task_services.fail_send,
                self.task_pk,
                f"{reason}; the agent has no task for this message, so retrying is safe",
                retry_safe=True,
                fence=self.token,
            )
        else:
            await eventloop.db(
                task_services.fail_send,
                self.task_pk,
                f"{reason}; could not tell whether the agent has the task ({found.problem}). "
                "Refresh looks it up again; abandon gives it up.",
                retry_safe=False,
                fence=self.token,
            )
        return Turn(next_status(self.status, Event.ENDED), "send failed")

    # -- 2. one turn of following a known task
    async def _follow_turn(self, client: A2AClient) -> Outcome:
        """One stream (until it closes or the turn ends) or one poll; failures become the outcome."""
        outcome = Outcome()
        try:
            if self.streaming:
                await self._go(Event.FOLLOW)
                try:
                    outcome = await self._pump(
                        client.subscribe_to_task(self.remote_id), "resubscribe", "stream"
                    )
                except (UnsupportedOperationError, InvalidParamsError, TaskNotFoundError) as exc:
                    # Terminal task (or a server's variant of saying so: some answer "not
                    # found" for a task that ended): GetTask decides; it says gone if so. No
                    # stream was live since the last one: what its snapshot shows that the
                    # log does not was missed, and a ``gap`` says so.
                    outcome = await self._poll_once(client, gap_check=True)
                    if self.state not in TERMINAL_STATES:
                        await self._system("subscribe-refused", f"{exc}; polling instead")
                        self.streaming = False
                        # Kept on the task, as a refused push is: each holder after this one
                        # was refused again, a request and a row every slice.
                        await eventloop.db(self._to_polling, RemoteTask.Watch.STREAM)
                    return outcome
                if self.state not in TERMINAL_STATES and self.state != INPUT_REQUIRED:
                    # A stream that closed while the task goes on proves nothing:
                    # GetTask, and say so if it shows what the stream did not.
                    checked = await self._poll_once(client, gap_check=True)
                    outcome.progress = outcome.progress or checked.progress
                    outcome.over_budget = outcome.over_budget or checked.over_budget
                    outcome.confirmed = checked.confirmed and not checked.problem
                    outcome.problem = checked.problem or outcome.problem
            else:
                await self._go(Event.FOLLOW)
                outcome = await self._poll_once(client)
        except TaskNotFoundError:
            raise
        except TransportError as exc:
            outcome.problem = str(exc)
            if self.fruitless == 0:  # the first of a series, not every retry
                await self._system("stream-dropped" if self.streaming else "poll-failed", str(exc))
            if isinstance(exc, ConnectError):
                await eventloop.db(agent_services.mark_unreachable, self.agent_id, str(exc))
        except ProtocolError as exc:
            outcome.problem = str(exc)
            await self._note_problem(str(exc))
        except RemoteError as exc:
            outcome.problem = str(exc)
            await eventloop.db(agent_services.mark_reachable, self.agent_id)
            await self._system("agent-error", str(exc))
        return outcome

    async def _poll_once(self, client: A2AClient, *, gap_check: bool = False) -> Outcome:
        # A large reply keeps its slot until it is recorded (see a2a.large_body_scope).
        async with large_body_scope():
            polled = await poll_task(client, self.remote_id, self.task_pk, self.poll_length)
            self.poll_length = polled.next_length
            await eventloop.db(agent_services.mark_reachable, self.agent_id)
            result = await eventloop.db(
                record,
                self.task_pk,
                {"task": polled.task},
                "poll",
                gap_check=gap_check,
                fence=self.token,
            )
        outcome = Outcome()
        outcome.add(result)
        self.state = result.state
        return outcome

    # -- streams into record_many, in batches, within the events-per-second budget
    async def _pump(
        self,
        events: AsyncIterator[StreamEvent],
        first_channel: str,
        channel: str,
        *,
        clear_outbox: str = "",
    ) -> Outcome:
        """Record a stream's events until it closes, the turn ends, or the slice is over.

        A reader task queues events (a bounded queue: a flooding agent waits on
        its TCP window); this coroutine records whatever has queued up in one
        transaction, so a fast stream costs one commit per batch rather than
        per event. While the task waits for authorization, the outbox is looked
        at every second so that an answer goes out at once.

        The queue is bounded in bytes too (``STREAM_READ_AHEAD_BYTES``, or one
        event of any size): bounded in events only, a stream of 1 MB chunks was
        read up to 1,000 MB ahead of the recorder, so a worker's memory grew
        with the artifact (2.4 times its size, measured).

        An event past ``LARGE_BODY_BYTES`` is read in a ``large_body_scope``: it takes one
        of its agent's large-body slots on this loop and the reader keeps it, reading no
        further, until the recorder has stored the event. So an agent's large events, over
        all its streams (and its large replies), are held at most a slot's worth at a time.
        """
        queue: asyncio.Queue[tuple[Any, int, asyncio.Event | None]] = asyncio.Queue(
            maxsize=2 * BATCH
        )
        done = object()
        outcome = Outcome()
        read_ahead = STREAM_READ_AHEAD_BYTES
        queued = 0  # bytes of events waiting in the queue
        room = asyncio.Event()  # set when the recorder took some

        async def reader() -> None:
            nonlocal queued
            try:
                async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
                    while True:
                        async with large_body_scope() as scope:
                            try:
                                event = await anext(stream)
                            except StopAsyncIteration:
                                break
                            size = _event_size(event)
                            while queued and queued + size > read_ahead:
                                room.clear()
                                await room.wait()
                            queued += size
                            stored = asyncio.Event() if scope.holding else None
                            await queue.put((event, size, stored))
                            if stored is not None:
                                await stored.wait()  # the slot is kept until it is recorded
            except asyncio.CancelledError:
                raise  # the turn is over: never wait on a full queue nobody reads
            except BaseException as exc:
                await queue.put((exc, 0, None))
                return
            await queue.put((done, 0, None))

        reader_task = self.loop.create_task(reader())
        first = True
        try:
            while True:
                timeout = self.deadline - self.loop.time()
                if timeout <= 0:
                    raise HandOver
                waiting_for_auth = self.state == AUTH_REQUIRED
                try:
                    item = await asyncio.wait_for(
                        queue.get(),
                        min(timeout, OUTBOX_CHECK_SECONDS) if waiting_for_auth else timeout,
                    )
                except TimeoutError:
                    if waiting_for_auth and self.loop.time() < self.deadline:
                        if await eventloop.db(task_services.has_outbox, self.task_pk):
                            raise OutboxReady from None
                        continue
                    raise HandOver from None
                taken = [item]
                while not queue.empty() and len(taken) < BATCH:
                    taken.append(queue.get_nowait())
                queued -= sum(size for _, size, _ in taken)
                room.set()
                batch = [event for event, _, _ in taken]
                events_only = [e for e in batch if isinstance(e, StreamEvent)]
                end = next((e for e in batch if not isinstance(e, StreamEvent)), None)
                if events_only:
                    if clear_outbox:
                        await eventloop.db(task_services.clear_outbox, self.task_pk, clear_outbox)
                        clear_outbox = ""
                    if first and first_channel != channel:
                        result = await eventloop.db_urgent(
                            record,
                            self.task_pk,
                            events_only[0].raw,
                            first_channel,
                            fence=self.token,
                        )
                        outcome.add(result)
                        events_only = events_only[1:]
                    calls = [
                        Batch([e.raw for e in events_only[start : start + RECORD_CALL_EVENTS]])
                        for start in range(0, len(events_only), RECORD_CALL_EVENTS)
                    ]
                    for call, ahead in itertools.zip_longest(calls, calls[1:]):
                        # The next call's events are parsed and folded while this one
                        # waits on the database (record_many's ``ahead``).
                        result = await eventloop.db_urgent(
                            record_many, self.task_pk, call, channel, fence=self.token, ahead=ahead
                        )
                        outcome.add(result)
                    for _, _, stored in taken:
                        if stored is not None:
                            stored.set()  # a large event's reader may let its slot go
                    if first:
                        await eventloop.db(agent_services.mark_reachable, self.agent_id)
                    first = False
                    if outcome.progress and (self.fruitless or self.was_parked):
                        # Judged at the first news, not when the stream ends: a parked (or
                        # reconnecting) task whose agent streams healthily for the whole
                        # slice showed "needs attention" all along, its series not ended.
                        await self._series_ends()
                        await self._go(Event.PROGRESS)
                    self.state = result.state
                    if not self.remote_id:
                        self.remote_id = await eventloop.db(
                            lambda: (
                                RemoteTask.objects.filter(pk=self.task_pk)
                                .values_list("remote_id", flat=True)
                                .first()
                                or ""
                            )
                        )
                    if outcome.over_budget:
                        return outcome
                    if self.state in TERMINAL_STATES or self.state == INPUT_REQUIRED:
                        return outcome
                    await self._throttle(len(batch))
                if isinstance(end, BaseException):
                    if isinstance(end, A2AError) and (outcome.progress or outcome.confirmed):
                        # The stream spoke validly, then broke (a proxy's idle cut, a restart):
                        # not a fruitless turn. The GetTask check after it says what was missed.
                        if outcome.progress or isinstance(
                            end, RemoteError
                        ):  # a silent cut is not news
                            await self._system(
                                "stream-dropped"
                                if isinstance(end, TransportError)
                                else "stream-error",
                                str(end),
                            )
                        outcome.dropped = True
                        return outcome
                    raise end
                if end is done:
                    return outcome
        finally:
            reader_task.cancel()
            await asyncio.gather(reader_task, return_exceptions=True)

    def _after_drop(self, started: float) -> float:
        """How long to wait before reopening a stream that brought news, then broke.

        Each break of a stream that lived less than ``WATCH_BACKOFF_MAX_SECONDS`` is the next
        step of the backoff; a stream that lived longer starts the series again. With a
        fixed first step, an agent that cut every stream after one new event was
        reconnected to about three times a second per task, with a ``stream-dropped`` row
        each time, for as long as its events were new (system rows count against no
        budget); now the reconnections slow down to one every 15-30 s (the defaults). A
        proxy that cuts idle streams every minute still gets the first step each time.
        """
        quick = self.loop.time() - started < settings.WATCH_BACKOFF_MAX_SECONDS
        self.drops = self.drops + 1 if quick else 1
        return backoff(self.drops)

    async def _throttle(self, recorded: int) -> None:
        """Keep a task within BUDGET_TASK_EVENTS_PER_SECOND: past a one-second burst, wait."""
        rate = settings.BUDGET_TASK_EVENTS_PER_SECOND
        if rate <= 0:
            return
        now = self.loop.time()
        self.paid_until = max(self.paid_until, now) + recorded / rate
        ahead = self.paid_until - now - 1.0
        if ahead > 0:
            if not self.throttled:
                self.throttled = True
                await self._system(
                    "throttled",
                    f"the agent sends more than {rate:g} events per second; recording at that rate",
                )
            await self._sleep(ahead)

    # -- small helpers
    async def _go(self, event: Event, note: str = "") -> None:
        """Move to the table's next status for ``event`` (written only when it changes)."""
        status = next_status(self.status, event, streaming=self.streaming)
        if status == self.status and not note:
            return  # nothing to write (and the note of a series stays)
        held = await eventloop.db(
            task_services.set_watcher_status, self.task_pk, self.token, status, note
        )
        if not held:
            raise Fenced
        self.status = status

    def _check_slice(self) -> None:
        if self.loop.time() >= self.deadline:
            raise HandOver

    async def _sleep(self, seconds: float) -> None:
        """Sleep within the slice; while authorization is awaited, wake for an answer."""
        end = min(self.loop.time() + seconds, self.deadline)
        while True:
            remaining = end - self.loop.time()
            if remaining <= 0:
                break
            if self.state == AUTH_REQUIRED:
                await asyncio.sleep(min(remaining, OUTBOX_CHECK_SECONDS))
                if await eventloop.db(task_services.has_outbox, self.task_pk):
                    return
            else:
                await asyncio.sleep(remaining)
        if self.loop.time() >= self.deadline:
            raise HandOver

    def _to_polling(self, watch: str) -> None:
        """The task, watched by ``watch`` still, is polled from now on (an operator can switch back)."""
        RemoteTask.objects.filter(pk=self.task_pk, watch=watch).update(watch=RemoteTask.Watch.POLL)

    async def _push_refused(self, reason: str) -> None:
        """Push cannot follow this task: say so once and poll instead."""
        await self._system("push-unavailable", f"{reason}; polling instead")
        await eventloop.db(self._to_polling, RemoteTask.Watch.PUSH)

    async def _system(self, event: str, detail: str) -> None:
        """Log one of the holder's own entries; a note in ``REPEATED_NOTES`` at most once per
        ``WATCH_REPEATED_NOTE_SECONDS``, the next one saying how many came in between.

        Those notes can come back every turn, and they count against no budget (they are
        ours, not the agent's content): an agent that answers an error, then a snapshot equal
        to the mirror (which ends a fruitless series), and so on, or whose every stream sends
        the task and then an error, wrote one row every turn, about ten a minute per task,
        for as long as the task was watched. The agent's own entries are all logged, and the
        watcher's note shows the latest problem.
        """
        if event in REPEATED_NOTES:
            now = self.loop.time()
            logged, held = self.notes.get(event, (-math.inf, 0))
            if now - logged < settings.WATCH_REPEATED_NOTE_SECONDS:
                self.notes[event] = (logged, held + 1)
                return
            if held:
                detail = f"{detail[:1800]} ({held} more like this since the last such entry)"
            self.notes[event] = (now, 0)
        await self._log_system(event, detail)

    async def _held_notes(self) -> None:
        """At the end of the holder's turn, the repeated notes not logged yet, as one count each."""
        for event, (_, held) in list(self.notes.items()):
            if not held:
                continue
            self.notes[event] = (self.loop.time(), 0)
            try:
                await self._log_system(
                    event,
                    f"{held} more like this since the last such entry (not logged one by one)",
                )
            except Fenced:
                return  # the lease moved on: the next holder speaks for the task
            except Exception as exc:  # the count is lost, the lease must still be given back
                log.warning(
                    "could not log the held notes of task %s: %s", self.task_pk, type(exc).__name__
                )
                return

    async def _log_system(self, event: str, detail: str) -> None:
        result = await eventloop.db(
            record,
            self.task_pk,
            {"system": {"event": event, "detail": detail[:2000]}},
            "system",
            fence=self.token,
        )
        if result.fenced:
            raise Fenced

    async def _note_problem(self, message: str) -> None:
        try:
            result = await eventloop.db(
                record,
                self.task_pk,
                {"protocolError": {"message": message[:2000]}},
                "system",
                fence=self.token,
            )
        except Exception as exc:  # recording the problem must not become a second one
            log.warning(
                "could not record a protocol error for task %s: %s",
                self.task_pk,
                type(exc).__name__,
            )
            return
        if result.fenced:
            raise Fenced


def _event_size(event: Any) -> int:
    """About how many bytes an event holds (its JSON), for the stream queue's byte bound."""
    try:
        return len(json.dumps(getattr(event, "raw", None)))
    except (TypeError, ValueError):
        return 0


def _message_id(message: Any) -> Any:
    """A status message's id (None when there is no message, or it has none)."""
    return message.get("messageId") if isinstance(message, dict) else None


def answer_fate(snapshot: Any, message_id: str, state: str, status_message: Any) -> str:
    """What became of an answer sent before, by the agent's snapshot (see ``_answer_arrived``).

    ``"arrived"``: the message is in the task's history. ``"moved on"``: the task no
    longer waits in ``state`` on ``status_message`` (the question the answer was for).
    ``"waiting"``: neither, so it is sent. The snapshot is the agent's JSON: anything of
    the wrong shape counts as absent.
    """
    snapshot = snapshot if isinstance(snapshot, dict) else {}
    history = snapshot.get("history")
    if isinstance(history, list) and any(
        isinstance(m, dict) and m.get("messageId") == message_id for m in history
    ):
        return "arrived"
    status = snapshot.get("status")
    status = status if isinstance(status, dict) else {}
    if status.get("state") == state and _message_id(status.get("message")) == _message_id(
        status_message
    ):
        return "waiting"
    return "moved on"


def backoff(failures: int) -> float:
    """Exponential backoff with jitter (50-100%), capped at WATCH_BACKOFF_MAX_SECONDS."""
    cap = settings.WATCH_BACKOFF_MAX_SECONDS
    return random.uniform(0.5, 1.0) * min(
        cap, settings.WATCH_BACKOFF_BASE_SECONDS * 2 ** max(failures - 1, 0)
    )
