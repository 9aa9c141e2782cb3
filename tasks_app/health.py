"""``/healthz``: is every part the dashboard needs answering, within a bounded time?

Load balancers and ``manage.py up`` poll it without logging in, so the public answer says
only ``{"ok": true}`` (200) or ``{"ok": false}`` (503): which part is down, and how, tells an
outsider about the deployment. A logged-in staff user also gets each check by name with a
short fixed sentence, never an exception's text (a driver's message can hold a host, a user
name or a URL).

Every check runs in its own thread with its own timeout, all at once, under one total
deadline (``HEALTH_DEADLINE_SECONDS``): a hung Redis or database makes the answer "not ok"
in time instead of hanging the poller. A check still running from an earlier request is not
started again (it counts as failing), so a dependency that hangs costs at most one thread
per check, however often the endpoint is polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import redis
from asgiref.sync import async_to_sync
from channels import DEFAULT_CHANNEL_LAYER
from channels.layers import channel_layers
from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache

logger = logging.getLogger(__name__)

# The whole answer is given within this many seconds, whatever hangs.
HEALTH_DEADLINE_SECONDS = 3.0
# How long past its own timeout a check is waited for (still within the deadline).
GRACE_SECONDS = 1.0


class CheckFailed(Exception):
    """A check's own verdict; its message is a fixed sentence, safe to show staff."""


@dataclass(frozen=True)
class Check:
    """One dependency: how to probe it (``run(timeout)``) and the timeout it is given."""

    name: str
    run: Callable[[float], None]
    timeout: float
    # Said to staff when ``run`` raises something other than CheckFailed.
    failure: str
    # Said instead when the part answered and refused (see REFUSALS).
    refused: str = ""


@dataclass(frozen=True)
class Result:
    ok: bool
    message: str
    ms: float

    def as_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "message": self.message, "ms": self.ms}


# Errors that mean the part answered and said no: a Redis that wants another password, is
# out of memory or read-only, or has no such database. "Did not answer" sent the operator
# after the network instead.
REFUSALS = (redis.exceptions.ResponseError, redis.exceptions.AuthenticationError)


def check_database(timeout: float) -> None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        # Runs in a pool thread: its connection is its own and is not reused by a request.
        connection.close()


def check_redis(timeout: float) -> None:
    client = redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=timeout, socket_connect_timeout=timeout
    )
    try:
        client.ping()
    finally:
        client.close()


def check_channel_layer(timeout: float) -> None:
    """A message sent on the channel layer comes back, through a layer of the check's own.

    Not through the process's layer: channels_redis lets one event loop at a time receive
    on a layer, and in the web process daphne's loop receives for every open websocket, so
    a receive from this thread's loop raised ``RuntimeError`` and ``/healthz`` said "not
    ok" whenever anyone had a page open. The check's layer has the same configuration, so
    it asks the same Redis the same way, and its connections are closed when it is done.
    """
    if DEFAULT_CHANNEL_LAYER not in getattr(settings, "CHANNEL_LAYERS", {}):
        raise CheckFailed("no channel layer is configured")

    async def round_trip(layer: Any) -> None:
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "health.ping"})
        message = await layer.receive(channel)
        if message.get("type") != "health.ping":
            raise CheckFailed("the channel layer returned another message")

    async def bounded() -> None:
        layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
        try:
            # layer.receive() waits forever for a message that never comes without this.
            await asyncio.wait_for(round_trip(layer), timeout)
        finally:
            close = getattr(layer, "close_pools", None)
            if close is not None:
                with contextlib.suppress(Exception):  # Redis away: the check says so already
                    await asyncio.wait_for(close(), timeout)

    async_to_sync(bounded)()


def _bound_workers(app: Any, conn: Any) -> int | None:
    """How many workers' control queues the broker has bound, or None if it cannot tell.

    Each worker binds one queue to the control exchange while it runs and unbinds it when it
    stops; on Redis the bindings are a set the transport reads (``get_table``). A worker
    that was killed leaves its binding behind, so the count can be high, never low.
    """
    get_table = getattr(conn.default_channel, "get_table", None)
    if get_table is None:  # a transport that keeps its bindings to itself
        return None
    return len({binding[-1] for binding in get_table(app.control.mailbox.exchange.name)})


class _OursAnswered(Exception):
    """A worker consuming this dashboard's queue answered: the others need not be waited for."""


def _consumes(queue: str, queues: Any) -> bool:
    return isinstance(queues, list) and any(
        isinstance(q, dict) and q.get("name") == queue for q in queues
    )


def check_worker(timeout: float) -> None:
    """A worker that consumes this dashboard's queue answers.

    Any worker on the same Redis answered a ping, a worker of another dashboard sharing it
    (``CELERY_QUEUE``) too: so the workers are asked which queues they consume.

    1. With no worker bound to the control exchange nobody can answer: the check fails at
       once.
    2. The check is done at the first reply of a worker that consumes this dashboard's
       queue; each reply is looked at as it arrives (a healthy deployment's check took its
       whole timeout, a second, before).
    3. Otherwise the replies are waited for, but no longer than it takes the workers the
       broker has bound to answer (or the timeout), and the check fails.

    A killed worker leaves its binding behind (the broker cannot tell it from a slow
    worker): it costs the timeout only when no worker of ours answers. One broker
    connection serves both questions.
    """
    from dashboard.celery import app

    queue = settings.CELERY_TASK_DEFAULT_QUEUE

    def look(reply: Any) -> None:  # called by kombu for each reply as it arrives
        if isinstance(reply, dict) and any(_consumes(queue, q) for q in reply.values()):
            raise _OursAnswered

    with app.connection_for_write() as conn:  # the one a broadcast publishes on
        bound = _bound_workers(app, conn)
        if bound == 0:  # 1
            raise CheckFailed("no Celery worker answered")
        inspect = app.control.inspect(timeout=timeout, limit=bound, connection=conn, callback=look)
        try:
            replies = inspect.active_queues() or {}
        except _OursAnswered:  # 2
            return
    if not replies:  # 3
        raise CheckFailed("no Celery worker answered")
    if not any(_consumes(queue, queues) for queues in replies.values()):
        raise CheckFailed("no Celery worker consumes this dashboard's queue (CELERY_QUEUE)")


CHECKS: tuple[Check, ...] = (
    Check("database", check_database, 2.0, "the database did not answer"),
    # Redis answers in milliseconds; 1.5 s leaves its own timeout 1.5 s before the deadline,
    # so a hung Redis is named as such even on a busy machine (with 2.0 s, a loaded CI
    # machine once passed the deadline first).
    Check("redis", check_redis, 1.5, "Redis did not answer", "Redis refused the command"),
    Check(
        "channel_layer",
        check_channel_layer,
        1.5,
        "the channel layer did not answer",
        "the channel layer's Redis refused the command",
    ),
    # kombu collects replies in whole-second polls: a 1.5 s wait takes over 2 s, a 1 s one ~1 s.
    Check("worker", check_worker, 1.0, "no Celery worker answered"),
)

# At most one thread per check is busy (see _start), so checks never queue behind others.
_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="healthz")
_running: dict[str, Future[None]] = {}
_running_lock = threading.Lock()


def _start(check: Check) -> Future[None] | None:
    """Start ``check`` unless its previous run has not finished (None then)."""
    with _running_lock:
        previous = _running.get(check.name)
        if previous is not None and not previous.done():
            return None
        future = _pool.submit(check.run, check.timeout)
        _running[check.name] = future
        return future


def _verdict(check: Check, future: Future[None] | None, started: float, deadline: float) -> Result:
    if future is None:
        return Result(False, "an earlier check has not finished yet", 0.0)
    # The check bounds itself (socket and receive timeouts); the margin only catches one
    # that does not, such as a connect the driver retries.
    limit = min(started + check.timeout + GRACE_SECONDS, deadline)
    ok = False
    try:
        future.result(timeout=max(0.0, limit - time.monotonic()))
    except FutureTimeout:
        message = f"no answer within {limit - started:.1f} s"
    except CheckFailed as exc:
        message = str(exc)
    except Exception as exc:  # any driver error: its class, never its text (log_change says it)
        said = check.refused if check.refused and isinstance(exc, REFUSALS) else check.failure
        message = f"{said} ({type(exc).__name__})"
    else:
        ok, message = True, "ok"
    return Result(ok, message, round((time.monotonic() - started) * 1000, 1))


def run_checks(deadline_seconds: float = HEALTH_DEADLINE_SECONDS) -> dict[str, Result]:
    """Every check at once; answers within ``deadline_seconds`` whatever hangs."""
    started = time.monotonic()
    deadline = started + deadline_seconds
    futures = [(check, _start(check)) for check in CHECKS]
    return {check.name: _verdict(check, future, started, deadline) for check, future in futures}


# The previous answer's verdict in this process (None: no answer yet), and whether any answer
# was ok, for log_change().
_last_ok: bool | None = None
_been_ok = False


def log_change(results: dict[str, Result]) -> None:
    """One log line when the verdict changes, naming what is down; none while it holds.

    Pollers ask every few seconds, and Django logged every 503 as an ERROR that named no
    check: a worker still starting made one on every clean start of ``manage.py up``, and a
    part that stays down one per poll. Now: the first answer of a process, if not ok, is
    INFO ("not ready yet": parts start side by side, and "ready" once they answer); a
    failure after an ok answer is a WARNING, the return to ok INFO. The messages are the
    checks' fixed sentences.
    """
    global _last_ok, _been_ok
    ok = all(result.ok for result in results.values())
    previous, _last_ok = _last_ok, ok
    been_ok, _been_ok = _been_ok, _been_ok or ok
    if ok == previous:
        return
    down = "; ".join(f"{name}: {r.message}" for name, r in results.items() if not r.ok)
    if ok:
        if previous is not None:
            logger.info("Health: " + ("every check answers again" if been_ok else "ready"))
    elif previous is None:
        logger.info("Health: not ready yet (%s)", down)
    else:
        logger.warning("Health: not ok (%s)", down)


def _is_staff(request: HttpRequest) -> bool:
    """Whether the checks may be shown. The session is read from the database, which may be
    the part that is down: then only ``{"ok": false}``, never a 500 for the staff."""
    user = getattr(request, "user", None)
    try:
        return bool(user is not None and user.is_authenticated and user.is_staff)
    except DatabaseError:
        return False


@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    results = run_checks()
    log_change(results)
    ok = all(result.ok for result in results.values())
    body: dict[str, object] = {"ok": ok}
    if _is_staff(request):
        body["checks"] = {name: result.as_dict() for name, result in results.items()}
    response = JsonResponse(body, status=200 if ok else 503)
    # Said once by log_change(), not once per poll by Django's request logger (the flag is
    # the one Django sets itself on a response it has logged).
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response
