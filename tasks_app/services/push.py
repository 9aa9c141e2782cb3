"""Push notifications: our configs, the webhook's checks, and the queue behind it.

A push-watched task holds no connection: the agent POSTs each event to a URL of ours, one
URL per config (``PUBLIC_URL/push/<config_id>/``). The webhook (``tasks_app/webhooks.py``)
calls :func:`accept`, which does only what must happen before answering: cheap limits,
the config lookup, constant-time credential checks, a signed token when the agent signs,
the task check and a repeat check, then one push onto a Redis list. It answers 202 at
once. :func:`drain` (a Celery job, ``tasks_app.jobs.drain_push``) takes the list in
batches, records each task's notifications through ``record_many()`` on channel
``push``, and then asks the agent for the task (``GetTask``): a notification is a hint,
the agent's task is the truth. A task that ended is settled and its configs deleted.

Why a Redis list and not a Celery message per notification: accepting must stay within
a few milliseconds at a thousand notifications a second; one ``RPUSH`` costs about a
tenth of a millisecond, a Celery publish several, and the drain records a batch of a
task's notifications in one transaction.

Silence: the watcher releases a push-watched task with a hold-off of
``PUSH_SILENCE_SECONDS`` ("awaiting push"); every accepted notification moves the
hold-off forward (:func:`heard`). When it runs out the reconciler hands the task to a
watcher, which polls it once and comes back later, less often as the silence grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import random
import secrets
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import httpx
import jwt
import redis
import redis.asyncio
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, models, transaction
from django.db.models import Case, F, Q, Value, When
from django.db.models.functions import Greatest
from django.utils import timezone

from tasks_app import eventloop, outbound
from tasks_app.a2a import A2AClient, A2AError, ProtocolError, large_body_scope, safejson
from tasks_app.a2a.states import STATE_INPUT_REQUIRED
from tasks_app.crypto import SecretError, decrypt_json, encrypt_json
from tasks_app.models import TERMINAL_STATES, Agent, PushConfig, RemoteTask
from tasks_app.runtime import shared_redis
from tasks_app.services.polls import POLL_HISTORY, poll_task
from tasks_app.services.record import (
    WAITING_FOR_ANSWER,
    RecordError,
    record,
    record_many,
    settle_if_ended,
)

log = logging.getLogger(__name__)
security_log = logging.getLogger("tasks_app.security")

CONTENT_TYPES = ("application/a2a+json", "application/json")
EVENT_KINDS = ("task", "message", "statusUpdate", "artifactUpdate")
QUEUE_KEY = "push:queue"
# Bytes the queue holds (added by the queue script, taken off with a recorded batch by the
# drain; set to 0 when the drain finds the queue empty, whatever a count gone wrong left).
QUEUE_BYTES_KEY = "push:queue:bytes"
# The last stamp the queue script gave a delivery (its ``n``): Redis' clock in microseconds,
# or one more than the last stamp when the clock has not moved on. Each delivery's stamp is
# larger than every earlier one, a Redis that lost its keys included (the clock goes on), so
# a push config's ``counted_through`` tells a batch counted already from a new one.
SEQ_KEY = "push:queue:seq"
DRAIN_KEY = "push:drain"
# Notifications taken from the queue at once. Each task's share is one record_many()
# transaction, whose fixed cost (read the task, commit, relay) dominates at a few
# notifications: a drain that fell behind takes bigger batches and catches up.
DRAIN_BATCH = 5000
# When a batch was busy (this many or more), the drain waits before the next, so each
# task's share grows: a record_many() call has a fixed cost (read the task, the
# compare-and-set, the commit, the relay) of about ten notifications' worth, so at 1,000
# notifications/s over 200 tasks the worker spent 2.3-2.8 ms of CPU per notification at 2.5
# a task and 1.0-1.1 ms at 10 (measured in-process, SQLite, on a loaded machine). It waits until the queue holds
# DRAIN_GATHER_PER_TASK for each task of the last batch, at most DRAIN_GATHER_SECONDS,
# looking every DRAIN_GATHER_POLL_SECONDS. A quiet queue is taken at once (a lone push task
# is not delayed).
DRAIN_GATHER_FROM = 100
DRAIN_GATHER_PER_TASK = 10
DRAIN_GATHER_SECONDS = 2.0
DRAIN_GATHER_POLL_SECONDS = 0.1
# Where the database takes concurrent writers (PostgreSQL), a batch's tasks are recorded in
# this many groups at once: each task's transaction waits on its commit, and the commits of
# four groups overlap (SQLite takes one writer at a time: one group there).
DRAIN_PARALLEL = 4
# The webhook's per-process cache of configs (see _lookup): how long a config found is
# trusted, and how long "no such config" is. A deletion through this module is honoured at
# once (a Redis marker, DELETED_PREFIX, lives longer than any cache entry); a config row
# removed otherwise (its task deleted) is refused once the cache reads it again (within
# CONFIG_CACHE_SECONDS of its last read, plus that read), and nothing queued for it
# meanwhile is recorded (the drain checks the config again).
CONFIG_CACHE_SECONDS = 10.0
# Past its time, a config found earlier is still used for this long while it is read again
# in the background (see _cached); a row removed behind our back is refused after that read.
STALE_SECONDS = 60.0
MISSING_CACHE_SECONDS = 1.0
CONFIG_CACHE_SIZE = 20_000
DELETED_PREFIX = "push:deleted:"
# The ids of live configs, so an id nobody was given is refused by the Redis script that
# counts the request, with no query and no thread (forgers send made-up ids). The set is
# filled from the database when KNOWN_READY is missing, which lives KNOWN_READY_SECONDS:
# a config row made some other way (a restored backup) is found by the next fill.
KNOWN_KEY = "push:configs"
KNOWN_READY = "push:configs:ready"
KNOWN_READY_SECONDS = 300
DELETED_MARK_SECONDS = int(
    CONFIG_CACHE_SECONDS + STALE_SECONDS + 30
)  # outlives any entry, stale or not
# The card extension by which an agent says it signs its notifications, and where its keys are.
SIGNING_EXTENSION = "urn:a2a-dashboard:push-signing:v1"
JWT_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA")
JWKS_MAX_BYTES = 64 * 1024
# An unknown key id makes us fetch the JWKS again, but not more often than this.
JWKS_REFETCH_SECONDS = 30.0
# A whole JWKS fetch (connect to last byte): a server trickling its keys is cut off.
JWKS_DEADLINE_SECONDS = 10.0
# A JWKS that could not be read is not fetched again for this long: every signed delivery
# would otherwise hold one of the webhook's few threads for up to the deadline.
JWKS_FAILURE_SECONDS = 30.0


# Availability and our configs -------------------------------------------------------------


def unavailable_reason(agent: Agent | None = None) -> str:
    """Why push cannot be offered (empty when it can).

    The sentence names the mode: the start form shows an error that does under its mode field.
    """
    if not settings.PUBLIC_URL:
        return (
            "The push mode needs PUBLIC_URL, the dashboard's address that agents can reach "
            "(manage.py up --demo sets it for the processes it starts; a command run from "
            "another shell needs it exported too)."
        )
    if agent is not None and not agent.push:
        return f"{agent.name} does not declare push notifications: choose another mode."
    return ""


def webhook_url(config_id: str) -> str:
    return f"{settings.PUBLIC_URL}/push/{config_id}/"


def signing_of(agent: Agent) -> tuple[str, str]:
    """The agent's JWKS URL and token issuer, when its card says it signs notifications."""
    card = agent.card if isinstance(agent.card, dict) else {}
    extensions = (card.get("capabilities") or {}).get("extensions") or []
    for extension in extensions if isinstance(extensions, list) else []:
        if isinstance(extension, dict) and extension.get("uri") == SIGNING_EXTENSION:
            params = extension.get("params") if isinstance(extension.get("params"), dict) else {}
            url = params.get("jwksUri")
            if isinstance(url, str) and url.startswith(("https://", "http://")):
                issuer = params.get("issuer") if isinstance(params.get("issuer"), str) else ""
                return url[:1000], (issuer or agent.base_url)[:1000]
    return "", ""


def new_config(task: RemoteTask, *, jwks_url: str = "", jwt_issuer: str = "") -> PushConfig:
    """A config with our own id and fresh single-purpose secrets.

    An agent that signs (a JWKS from its card, or ``jwks_url``) gets no
    ``authentication``: its ``Authorization`` header carries the signed token.
    """
    if not jwks_url:
        jwks_url, jwt_issuer = signing_of(task.agent)
    values = {"token": secrets.token_urlsafe(32)}
    if not jwks_url:
        values.update(scheme="Bearer", credentials=secrets.token_urlsafe(32))
    config = PushConfig.objects.create(
        task=task,
        config_id=uuid.uuid4().hex,
        secrets_encrypted=encrypt_json(values),
        jwks_url=jwks_url,
        jwt_issuer=jwt_issuer or (task.agent.base_url if jwks_url else ""),
    )
    remember(config.config_id)
    return config


def remember(config_id: str) -> None:
    """Add a live config to the webhook's set of known ids (idempotent).

    Best effort: this runs inside a watcher's database work, and a Redis that is down must
    not turn a send into a failed turn. The config is in the database; the set is filled
    from it again within KNOWN_READY_SECONDS, and a send that reuses the config adds it then.
    """
    try:
        _redis().sadd(KNOWN_KEY, config_id)
    except redis.RedisError as exc:
        log.warning("push config %s not added to the webhook's known set (%s); it is once "
                    "Redis answers", config_id, type(exc).__name__)  # fmt: skip


def wire_config(config: PushConfig) -> dict[str, Any]:
    """The config as the agent receives it (TaskPushNotificationConfig, without taskId).

    Secrets that cannot be decrypted (a rotated key not listed as old) raise
    ``outbound.CredentialsUnreadable``: the watcher parks the task with that sentence.
    """
    try:
        values = decrypt_json(config.secrets_encrypted)
    except SecretError as exc:
        raise outbound.CredentialsUnreadable(f"the push config's secrets: {exc}") from None
    wire: dict[str, Any] = {"id": config.config_id, "url": webhook_url(config.config_id)}
    if values.get("token"):
        wire["token"] = values["token"]
    if values.get("scheme"):
        wire["authentication"] = {
            "scheme": values["scheme"],
            "credentials": values.get("credentials", ""),
        }
    return wire


def config_for_send(task_pk: int) -> dict[str, Any] | None:
    """The inline config for a task's first send (made once; None when push is not possible)."""
    if not settings.PUBLIC_URL:
        return None
    task = RemoteTask.objects.select_related("agent").get(pk=task_pk)
    config = task.push_configs.filter(deleted_at__isnull=True).first()
    if config is None:
        config = new_config(task)
    else:
        remember(config.config_id)  # an earlier add may have met a Redis that was down
    return wire_config(config)


def mark_registered(config_id: str) -> None:
    PushConfig.objects.filter(config_id=config_id, registered_at__isnull=True).update(
        registered_at=timezone.now()
    )


async def ensure_registered(
    client: A2AClient, task_pk: int, remote_id: str, wire: dict[str, Any]
) -> str:
    """After a send that carried ``wire`` inline: make sure the agent holds it.

    Returns an empty string when it does, else why push cannot be used. An agent
    that ignored the inline config gets it again with CreateTaskPushNotificationConfig.
    """
    try:
        await client.get_push_config(remote_id, wire["id"])
    except A2AError:
        try:
            await client.create_push_config(
                remote_id,
                wire["url"],
                config_id=wire["id"],
                token=wire.get("token"),
                auth_scheme=(wire.get("authentication") or {}).get("scheme"),
                auth_credentials=(wire.get("authentication") or {}).get("credentials"),
            )
        except A2AError as exc:
            return f"the agent did not take the push config: {exc}"
    await eventloop.db(mark_registered, wire["id"])
    return ""


def silence(task_pk: int) -> float:
    """Seconds since the task last heard a push notification (or since its config was made)."""
    newest = None
    for received, registered, created in PushConfig.objects.filter(task_id=task_pk).values_list(
        "last_received_at", "registered_at", "created_at"
    ):
        moment = received or registered or created
        newest = moment if newest is None or moment > newest else newest
    if newest is None:
        return float("inf")
    return max(0.0, (timezone.now() - newest).total_seconds())


def _followed(task_pks: set[int]) -> Q:
    """The tasks of ``task_pks`` followed by push that nobody holds and that are not over."""
    return Q(
        pk__in=task_pks,
        watch=RemoteTask.Watch.PUSH,
        lease_token="",
        abandoned_at__isnull=True,
        gone_at__isnull=True,
        settled_at__isnull=True,
        # An answer waiting to be sent: its watcher must get the lease, not a new hold-off.
        outbox__isnull=True,
    ) & ~Q(state__in=TERMINAL_STATES)


def waiting_for_answer(task_pks: set[int]) -> None:
    """Push tasks that now ask a question (a notification, or the drain's GetTask, said so):
    nothing is awaited from the agent until someone answers, so the page said "awaiting
    push" where a streamed task says "waiting for an answer". Idle now, until the next look
    at the question (``WATCH_QUESTION_RECHECK_SECONDS``, as a streamed task's; the drain
    has just read the task) or the answer, whose watcher follows by push again."""
    Status = RemoteTask.WatcherStatus
    asking = _followed(task_pks) & Q(
        state=STATE_INPUT_REQUIRED, watcher_status=Status.AWAITING_PUSH
    )
    pks = list(RemoteTask.objects.filter(asking).values_list("pk", flat=True))
    if not pks:
        return
    now = timezone.now()
    RemoteTask.objects.filter(asking, pk__in=pks).update(
        watcher_status=Status.IDLE,
        watcher_note=WAITING_FOR_ANSWER,
        watcher_since=now,
        lease_expires_at=now + timedelta(seconds=settings.WATCH_QUESTION_RECHECK_SECONDS),
    )
    from tasks_app.services.tasks import relay_watcher

    for pk in pks:
        relay_watcher(pk)


def heard(task_pks: set[int]) -> None:
    """Notifications arrived: the silence fallback waits again, the page says "awaiting push".

    Only tasks nobody holds, still followed by push and not over (not ended, abandoned,
    gone or settled), with no answer waiting to be sent, are touched (a holder's lease is
    its own business; an answer's watcher must get the lease). Each write
    repeats the whole condition (compare-and-set): read first and written on the pks alone,
    an abandon, a switch to polling or a park committed in between was overwritten.
    """
    if not task_pks:
        return
    Status = RemoteTask.WatcherStatus
    now = timezone.now()
    until = now + timedelta(seconds=settings.PUSH_SILENCE_SECONDS)
    waiting_for_answer(task_pks)
    followed = _followed(task_pks) & ~Q(state=STATE_INPUT_REQUIRED)
    RemoteTask.objects.filter(followed, watcher_status=Status.AWAITING_PUSH).update(
        lease_expires_at=until
    )
    waiting_again = [Status.POLLING, Status.IDLE, Status.LOST, Status.RECONNECTING]
    candidates = list(
        RemoteTask.objects.filter(followed, watcher_status__in=waiting_again).values_list(
            "pk", flat=True
        )
    )
    if not candidates:
        return
    RemoteTask.objects.filter(followed, pk__in=candidates, watcher_status__in=waiting_again).update(
        lease_expires_at=until,
        watcher_status=Status.AWAITING_PUSH,
        watcher_note="push notifications arriving",
        watcher_since=now,
    )
    changed = RemoteTask.objects.filter(
        pk__in=candidates, watcher_status=Status.AWAITING_PUSH, watcher_since=now
    ).values_list("pk", flat=True)
    from tasks_app.services.tasks import relay_watcher

    for pk in changed:
        relay_watcher(pk)


async def forget_configs(client: A2AClient, task_pk: int, note: str) -> int:
    """Delete the task's live configs at the agent and here (the task settled, or an operator asked)."""

    def live() -> list[tuple[str, str]]:
        return list(
            PushConfig.objects.filter(task_id=task_pk, deleted_at__isnull=True).values_list(
                "config_id", "task__remote_id"
            )
        )

    deleted = 0
    for config_id, remote_id in await eventloop.db(live):
        if remote_id:
            try:
                await client.delete_push_config(remote_id, config_id)
            except A2AError as exc:  # ours is deleted anyway: its deliveries get 404 from now on
                log.info("deleting push config %s at the agent failed: %s", config_id, exc)
        deleted += await eventloop.db(mark_deleted, config_id, note)
    return deleted


def forget_later(task_pk: int, note: str) -> None:
    """After the commit, have a worker delete the task's live configs (at the agent, then
    here): the task was abandoned, or settled by an operator's cancel or refresh.

    Before, only a watcher's settle did: an abandoned task's agent went on pushing, and a
    push changed the task's state; a settled one's pushes each appended a protocol error.
    Deleted here only, the agent's pushes would be refused (404) and counted against its
    address, cutting off its other tasks' notifications.
    """

    def dispatch() -> None:
        if not PushConfig.objects.filter(task_id=task_pk, deleted_at__isnull=True).exists():
            return
        from tasks_app.jobs import forget_push_configs

        try:
            forget_push_configs.delay(task_pk, note)
        except Exception:  # no broker: deleted here at least (the webhook refuses them)
            log.exception("could not schedule deleting the push configs of task %s", task_pk)
            for config_id in _live_config_ids(task_pk):
                mark_deleted(config_id, note)

    transaction.on_commit(dispatch)


def _live_config_ids(task_pk: int) -> list[str]:
    return list(
        PushConfig.objects.filter(task_id=task_pk, deleted_at__isnull=True).values_list(
            "config_id", flat=True
        )
    )


def forget_configs_now(task_pk: int, note: str) -> int:
    """The worker's side of :func:`forget_later`: at the agent (best effort), then here."""
    task = RemoteTask.objects.select_related("agent").filter(pk=task_pk).first()
    if task is None:
        return 0
    live = _live_config_ids(task_pk)
    if live and task.remote_id:

        async def call(http: httpx.AsyncClient) -> None:
            client = outbound.client_for(task.agent, http)
            for config_id in live:
                try:
                    await client.delete_push_config(task.remote_id, config_id)
                except A2AError as exc:  # ours is deleted anyway
                    log.info("deleting push config %s at the agent failed: %s", config_id, exc)

        try:
            outbound.run(call)
        except Exception:
            log.exception("deleting the push configs of task %s at the agent failed", task_pk)
    return sum(mark_deleted(config_id, note) for config_id in live)


def mark_deleted(config_id: str, note: str) -> int:
    deleted = PushConfig.objects.filter(config_id=config_id, deleted_at__isnull=True).update(
        deleted_at=timezone.now(), deleted_note=note[:500]
    )
    forget_cached(config_id)
    return deleted


def forget_cached(config_id: str) -> None:
    """A config was deleted: every process's webhook refuses it from its next delivery.

    The webhook keeps configs in a per-process cache (:func:`_lookup`); the marker in
    Redis is checked in the same round trip that queues a delivery, so a deletion
    made here is honoured at once everywhere, cache or not.
    """
    _config_cache.pop(config_id, None)
    pipe = _redis().pipeline(transaction=False)
    pipe.set(f"{DELETED_PREFIX}{config_id}", 1, ex=DELETED_MARK_SECONDS)
    pipe.srem(KNOWN_KEY, config_id)
    try:
        pipe.execute()
    except redis.RedisError as exc:  # the row says deleted: caches that expire read it there
        log.warning("push config %s: the webhook's deletion mark was not set (%s); other "
                    "processes refuse it once their cache expires", config_id,
                    type(exc).__name__)  # fmt: skip


_fill_lock = threading.Lock()
_filled_at = -1e9


def _fill_known() -> int:
    """Put every live config's id in the set of known ids (see KNOWN_KEY); returns how many.

    Deliveries that find the set due wait for one fill (the others that came meanwhile
    do not read the table again).
    """
    global _filled_at
    with _fill_lock:
        if time.monotonic() - _filled_at < 5.0 and _redis().exists(KNOWN_READY):
            return 0
        ids = list(
            PushConfig.objects.filter(deleted_at__isnull=True).values_list("config_id", flat=True)
        )
        pipe = _redis().pipeline(transaction=False)
        for start in range(0, len(ids), 1000):
            pipe.sadd(KNOWN_KEY, *ids[start : start + 1000])
        pipe.set(KNOWN_READY, 1, ex=KNOWN_READY_SECONDS)
        pipe.execute()
        _filled_at = time.monotonic()
        return len(ids)


# Redis ----------------------------------------------------------------------------------------


def _redis() -> redis.Redis:
    return shared_redis.client(settings.REDIS_URL)


# Accepting one delivery -------------------------------------------------------------------------


@dataclass
class Verdict:
    """The webhook's answer: an HTTP status and a short public reason (never a secret)."""

    status: int
    reason: str
    schedule_drain: bool = False  # the first delivery since the last drain: one is to be scheduled

    @property
    def accepted(self) -> bool:
        return self.status < 300


@dataclass
class _Config:
    pk: int
    config_id: str
    task_pk: int
    remote_id: str
    secrets: dict[str, str] = field(
        repr=False
    )  # its repr (a log line, a debug page) leaves them out
    jwks_url: str
    jwt_issuer: str
    unreadable: bool = False  # its secrets could not be decrypted


UNREADABLE_PROBLEM = (
    "the config's secrets cannot be decrypted (stored with a key that FIELD_ENCRYPTION_KEY "
    "and FIELD_ENCRYPTION_OLD_KEYS no longer list)"
)

_config_cache: dict[str, tuple[float, _Config | None]] = {}


def _cached(config_id: str) -> tuple[bool, _Config | None, bool]:
    """(found in the cache, the config or None for "no such config", to be read again).

    A config found earlier whose time ran out is still used, and read again in the
    background (``refresh``; once: its entry gets a few seconds meanwhile): a genuine
    delivery never waits on the database behind other lookups (forgers' unknown ids).
    Safe because a deletion through this module is checked in Redis with every delivery,
    and the drain records nothing for a config that is gone.
    """
    cached = _config_cache.get(config_id)
    if cached is None:
        return False, None, False
    now = time.monotonic()
    if cached[0] > now:
        return True, cached[1], False
    if cached[1] is not None and cached[1].remote_id and now - cached[0] < STALE_SECONDS:
        _config_cache[config_id] = (now + 5.0, cached[1])
        return True, cached[1], True
    return False, None, False


def _lookup(config_id: str, *, fresh: bool = False) -> _Config | None:
    """The live config ``config_id``, from the per-process cache (unless ``fresh``) or one query.

    Why a cache: the lookup was 40% of an accepted delivery (the ORM building a join
    each time); a config changes only by being deleted, which :func:`forget_cached`
    makes visible at once. A config whose task is not yet named by the agent is kept
    only briefly, as the task check needs the name once it comes.
    """
    if len(config_id) > 64:
        return None
    now = time.monotonic()
    cached = _config_cache.get(config_id)
    if cached is not None and cached[0] > now and not fresh:
        return cached[1]
    config = _load(config_id)
    ttl = CONFIG_CACHE_SECONDS if config is not None and config.remote_id else MISSING_CACHE_SECONDS
    ttl *= random.uniform(0.7, 1.0)  # configs loaded together do not all expire together
    if len(_config_cache) >= CONFIG_CACHE_SIZE:
        expired = [k for k, (until, _) in list(_config_cache.items()) if until <= now]
        for key in expired or list(_config_cache)[:1000]:  # else the oldest thousand
            _config_cache.pop(key, None)
    _config_cache[config_id] = (now + ttl, config)
    return config


def _load(config_id: str) -> _Config | None:
    """One query (raw SQL: the ORM's SQL building cost more than the query itself)."""
    sql = (
        f"SELECT c.id, c.task_id, t.remote_id, c.secrets_encrypted, c.jwks_url, c.jwt_issuer "
        f"FROM {PushConfig._meta.db_table} c JOIN {RemoteTask._meta.db_table} t ON t.id = c.task_id "
        f"WHERE c.config_id = %s AND c.deleted_at IS NULL"
    )
    for attempt in (1, 2):
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, [config_id])
                row = cursor.fetchone()
            break
        except (OperationalError, InterfaceError):
            # The webhook's threads keep their connection; one the server dropped is opened again.
            if attempt == 2 or not connection.get_autocommit():
                raise
            connection.close()
    if row is None:
        return None
    pk, task_pk, remote_id, encrypted, jwks_url, issuer = row
    try:
        values = decrypt_json(encrypted)
    except SecretError:
        # Nothing can match: every delivery is refused, and the refusal says why.
        return _Config(pk, config_id, task_pk, remote_id or "", {}, jwks_url or "", issuer or "",
                       unreadable=True)  # fmt: skip
    return _Config(pk, config_id, task_pk, remote_id or "", values, jwks_url or "", issuer or "")


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(
        given.encode("utf-8", "replace"), expected.encode("utf-8", "replace")
    )


def _credentials_problem(config: _Config, authorization: str, token: str) -> str:
    """Every credential presented must be right, and at least one configured one presented.

    Agents differ in what they send (a2a-sdk sends both headers, older ones only
    the token), and each secret alone is 256 random bits.
    """
    if config.unreadable:
        return UNREADABLE_PROBLEM
    expected_token = config.secrets.get("token", "")
    scheme, credentials = config.secrets.get("scheme", ""), config.secrets.get("credentials", "")
    matched = False
    if token:
        if not expected_token or not _same(token, expected_token):
            return "wrong notification token"
        matched = True
    if config.jwks_url:
        if not matched:
            return "missing notification token"
        return ""  # the Authorization header carries the signed token, checked next
    if authorization:
        given_scheme, _, given = authorization.partition(" ")
        if not scheme or not (
            _same(given_scheme.lower(), scheme.lower()) & _same(given.strip(), credentials)
        ):
            return "wrong Authorization credentials"
        matched = True
    return "" if matched else "no credentials"


def _window(key: str, seconds: int) -> str:
    return f"{key}:{int(time.time()) // seconds}"


# The webhook's Redis work is done by scripts, each one round trip. A genuine delivery
# whose config is cached needs one: QUEUE_SCRIPT counts it against its source address
# (unless SOURCE_SCRIPT did already), then checks the deletion marker and the per-config
# rate, does the repeat check, pushes it onto the queue stamped (SEQ_KEY) and sets the
# drain flag. It
# answers 4292 (the address is over its refusals), 4291 (over its request rate), 404
# (deleted), 429 (the config over its rate), 200 (a repeat), 202 (queued) or 203 (queued,
# and a drain is to be scheduled). SOURCE_SCRIPT counts the request before a query (a
# config not cached): an address cut off costs no query. REFUSE_SCRIPT counts a refusal.
_SOURCE_CHECK = """
if ARGV[3] == '0' then
  local n = redis.call('INCR', KEYS[1])
  if n == 1 then redis.call('EXPIRE', KEYS[1], 5) end
  if tonumber(redis.call('GET', KEYS[2]) or '0') >= tonumber(ARGV[2]) then return 4292 end
  if n > tonumber(ARGV[1]) then return 4291 end
end
"""
SCRIPTS = {
    "source": _SOURCE_CHECK
    + """
if redis.call('EXISTS', KEYS[4]) == 0 then return 5 end
if redis.call('SISMEMBER', KEYS[3], ARGV[4]) == 0 then return 404 end
return 0
""",
    "refuse": _SOURCE_CHECK
    + """
local r = redis.call('INCR', KEYS[2])
if r == 1 then redis.call('EXPIRE', KEYS[2], 120) end
return 0
""",
    "queue": _SOURCE_CHECK
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then return 404 end
local c = redis.call('INCR', KEYS[4])
if c == 1 then redis.call('EXPIRE', KEYS[4], 5) end
if c > tonumber(ARGV[4]) then return 429 end
if tonumber(redis.call('GET', KEYS[8]) or '0') >= tonumber(ARGV[9]) then return 503 end
if ARGV[7] ~= '' and not redis.call('SET', ARGV[7], 1, 'NX', 'EX', ARGV[8]) then return 4011 end
if not redis.call('SET', KEYS[5], 1, 'NX', 'EX', ARGV[5]) then return 200 end
local now = redis.call('TIME')
local n = tonumber(now[1]) * 1000000 + tonumber(now[2])
local last = tonumber(redis.call('GET', KEYS[9]) or '0')
if n <= last then n = last + 1 end
local stamp = string.format('%.0f', n)
redis.call('SET', KEYS[9], stamp)
local item = '{"n": ' .. stamp .. ', ' .. string.sub(ARGV[6], 2)
redis.call('RPUSH', KEYS[6], item)
redis.call('INCRBY', KEYS[8], string.len(item))
if redis.call('SET', KEYS[7], 1, 'NX', 'EX', 60) then return 203 end
return 202
""",
}
SHAS = {name: hashlib.sha1(text.encode()).hexdigest() for name, text in SCRIPTS.items()}
OVER_LIMIT = {
    4291: Verdict(429, "too many requests from this address"),
    4292: Verdict(429, "too many refused requests from this address"),
}
_registered: dict[tuple[int, str], Any] = {}


def _script(r: redis.Redis, name: str) -> Any:
    """A script registered on ``r`` (EVALSHA, loaded again if the server forgot it)."""
    key = (id(r), name)
    if key not in _registered:
        _registered[key] = r.register_script(SCRIPTS[name])
    return _registered[key]


# What the checks ask their driver for: ("script", name, keys, args), ("lookup", config_id)
# or ("verify", config, signed token, body). One flow of checks, two drivers: accept()
# does each at once (the Django view, tests), accept_async() batches the scripts of
# concurrent deliveries into one round trip and sends the rest to threads (the ASGI route).
Op = tuple[Any, ...]
Flow = Generator[Op, Any, Verdict]


@functools.lru_cache(maxsize=4096)  # per request on the webhook's path; sources repeat
def source_group(address: str) -> str:
    """What the per-source limits count: an IPv4 address, or an IPv6 address's /64.

    One IPv6 host is usually given a whole /64 and can send from any of its 2**64
    addresses: counted per address, a forger rotating them was never cut off. An
    IPv4-mapped address counts as its IPv4 one; anything unparsable as itself.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:100]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _decide(
    config_id: str, body: bytes, content_type: str, authorization: str, token: str, source: str
) -> Flow:
    """The webhook's checks, cheapest refusal first; a body is parsed only after good credentials."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media not in CONTENT_TYPES:
        return Verdict(415, "expected application/a2a+json or application/json")
    if len(body) > settings.PUSH_MAX_BODY_BYTES:
        return Verdict(413, "body too large")
    group = source_group(source)
    by_source = [_window(f"push:rs:{group}", 1), _window(f"push:rf:{group}", 60)]
    limits = [settings.PUSH_RATE_PER_SOURCE, settings.PUSH_REFUSED_PER_SOURCE]
    hit, config, refresh = _cached(config_id)
    if refresh:
        yield ("refresh", config_id)
    counted = 0
    if not hit:
        known = yield (
            "script",
            "source",
            [*by_source, KNOWN_KEY, KNOWN_READY],
            [*limits, 0, config_id],
        )
        if known in OVER_LIMIT:
            return OVER_LIMIT[known]
        counted = 1
        if known == 5:  # the set of known ids is to be filled (first use, or its time ran out)
            yield ("fill",)
        config = None if known == 404 else (yield ("lookup", config_id))
    if config is None:
        return (
            yield from _refused(
                by_source,
                [*limits, counted],
                source,
                config_id,
                404,
                "unknown or deleted push config",
            )
        )
    problem = _credentials_problem(config, authorization, token)
    if problem:
        return (yield from _refused(by_source, [*limits, counted], source, config_id, 401, problem))
    # A body its own agent got wrong is counted against the address like a refusal: with
    # the config cached nothing else counted it, and each cost a parse of up to a megabyte.
    try:
        event = safejson.loads(body)
    except ProtocolError:
        problem = "malformed JSON"
    else:
        problem = _event_problem(event, config.remote_id)
    if problem:
        return (yield from _refused(by_source, [*limits, counted], source, config_id, 400, problem))
    jti_key, jti_seconds = "", 0
    if config.jwks_url:
        scheme, _, signed = authorization.partition(" ")
        problem, jti_key, jti_seconds = yield (
            "verify",
            config,
            signed.strip() if scheme.lower() == "bearer" else "",
            body,
        )
        if problem:
            return (
                yield from _refused(by_source, [*limits, counted], source, config_id, 401, problem)
            )
    digest = hashlib.sha256(body).hexdigest()
    item = _queued(config, event, body)
    keys = [*by_source, f"{DELETED_PREFIX}{config.config_id}", _window(f"push:rc:{config.config_id}", 1),
            f"push:seen:{config.config_id}:{digest}", QUEUE_KEY, DRAIN_KEY,
            QUEUE_BYTES_KEY, SEQ_KEY]  # fmt: skip
    outcome = yield ("script", "queue", keys, [*limits, counted, settings.PUSH_RATE_PER_CONFIG,
                                               settings.PUSH_DEDUPE_SECONDS, item, jti_key,
                                               jti_seconds,
                                               settings.PUSH_QUEUE_MAX_BYTES])  # fmt: skip
    if outcome in OVER_LIMIT:
        return OVER_LIMIT[outcome]
    if outcome == 4011:  # the same signed token at the same moment: one of them is a replay
        return (
            yield from _refused(
                by_source, [*limits, 1], source, config_id, 401,
                "replayed signed token (jti seen before)",
            )
        )  # fmt: skip
    if outcome == 404:
        _config_cache.pop(config.config_id, None)
        return (
            yield from _refused(
                by_source, [*limits, 1], source, config_id, 404, "unknown or deleted push config"
            )
        )
    if outcome == 429:
        return Verdict(429, "too many notifications for this config")
    if outcome == 503:
        return Verdict(503, "too many notifications wait to be recorded; try again later")
    if outcome == 200:
        return Verdict(200, "already received")
    return Verdict(202, "accepted", schedule_drain=outcome == 203)


def _queued(config: _Config, event: Any, body: bytes) -> bytes | str:
    """What the queue holds for one delivery: its config, its task and the event.

    The body was just parsed as a JSON object, so when it is plain UTF-8 (an object's
    opening brace first, no NUL byte: UTF-16 and UTF-32 text always has one) it goes in
    as it came instead of being encoded again (a tenth of a delivery's CPU, profiled);
    the drain parses it to the same event either way.
    """
    if body[:1] == b"{" and b"\x00" not in body:
        return b'{"c": %d, "t": %d, "e": %b}' % (config.pk, config.task_pk, body)
    return json.dumps({"c": config.pk, "t": config.task_pk, "e": event})


def _refused(
    keys: list[str], args: list[int], source: str, config_id: str, status: int, reason: str
) -> Flow:
    """A refused delivery: counted against its source, and one security log line.

    A source already over its refusals gets 429 instead, with no line (a forger
    cannot fill the log).
    """
    over = yield ("script", "refuse", keys, args)
    if over:
        return OVER_LIMIT[over]
    security_log.warning(
        "push webhook refused: status=%s reason=%s config=%r source=%r",
        status, reason, config_id[:64], source[:64],
    )  # fmt: skip
    return Verdict(status, reason)


def _do(op: Op) -> Any:
    """Carry out one step of the checks, blocking."""
    if op[0] == "script":
        return _script(_redis(), op[1])(keys=op[2], args=op[3])
    if op[0] in ("lookup", "refresh"):
        return _lookup(op[1], fresh=op[0] == "refresh")
    if op[0] == "fill":
        return _fill_known()
    return verify_signed(op[1], op[2], op[3])


def accept(
    config_id: str,
    *,
    body: bytes,
    content_type: str,
    authorization: str = "",
    token: str = "",
    source: str = "",
) -> Verdict:
    """Check one delivery and queue it; the verdict says what the webhook answers.

    Order matters: the cheapest refusals come first, so a flood of forged requests
    costs one Redis round trip each once its source is over the refusal limit; a
    body is parsed only for a config whose credentials were right. A genuine
    delivery whose config is cached costs one round trip and no query.
    """
    flow = _decide(config_id, body, content_type, authorization, token, source)
    result: Any = None
    try:
        while True:
            result = _do(flow.send(result))
    except StopIteration as done:
        verdict: Verdict = done.value
    if verdict.schedule_drain:
        _schedule_drain()
    return verdict


async def accept_async(
    config_id: str,
    *,
    body: bytes,
    content_type: str,
    authorization: str = "",
    token: str = "",
    source: str = "",
) -> Verdict:
    """:func:`accept` for an event loop: the same checks, nothing blocking on the loop.

    Scripts go through the loop's :class:`_Batcher`; a query, a signature check (it may
    fetch a JWKS) and scheduling the drain run on a few threads of their own.
    """
    loop = asyncio.get_running_loop()
    batcher = _batchers.get(loop)
    if batcher is None:
        batcher = _batchers[loop] = _Batcher()
    flow = _decide(config_id, body, content_type, authorization, token, source)
    result: Any = None
    try:
        while True:
            op = flow.send(result)
            if op[0] == "script":
                result = await batcher.call(op[1], op[2], op[3])
            elif op[0] == "refresh":  # in the background: this delivery goes on with what is cached
                loop.run_in_executor(_blocking(), _do, op)
                result = None
            else:
                result = await loop.run_in_executor(_blocking(), _do, op)
    except StopIteration as done:
        verdict: Verdict = done.value
    if verdict.schedule_drain:
        loop.run_in_executor(_blocking(), _schedule_drain)
    return verdict


_pool: ThreadPoolExecutor | None = None
# Few threads: each one busy in Python takes the GIL from the server's event loop, which
# every other delivery waits on; lookups (configs not cached, i.e. mostly unknown ids sent
# by forgers) then queue here instead of slowing every genuine delivery.
BLOCKING_THREADS = 4


def _blocking() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=BLOCKING_THREADS, thread_name_prefix="push-webhook")
    return _pool


class _Batcher:
    """The scripts of concurrent deliveries, sent together: one round trip for all that wait.

    Why: on a busy machine a round trip to Redis lasts as long as it takes to get
    redis-server and then this process scheduled again (milliseconds, not the
    tenth of a millisecond of an idle machine); one round trip per delivery made
    the time per delivery, not the CPU, the limit. Whatever waits while a round
    trip is under way goes in the next one, so the batches grow with the load.
    """

    def __init__(self) -> None:
        # One connection, not a pool: round trips go one at a time, and the client's
        # pipeline machinery cost more CPU per round trip than the checks themselves.
        self.pool = redis.asyncio.ConnectionPool.from_url(
            settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5
        )
        self.connection: Any = None
        self.pending: list[tuple[str, list[Any], list[Any], asyncio.Future[Any]]] = []
        self.sender: asyncio.Task[None] | None = None

    async def aclose(self) -> None:
        if self.connection is not None:
            await self.connection.disconnect()
            self.connection = None

    async def call(self, name: str, keys: list[Any], args: list[Any]) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append((name, keys, args, future))
        if self.sender is None:
            self.sender = asyncio.get_running_loop().create_task(self._send())
        return await future

    async def _send(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                try:
                    results = await self._round_trip(batch)
                except Exception as exc:  # Redis unreachable: each delivery gets the error (503)
                    results = [exc] * len(batch)
                for (*_, future), result in zip(batch, results, strict=True):
                    if future.done():  # the delivery's connection went away meanwhile
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self.sender = None

    async def _round_trip(self, batch: list[tuple[str, list[Any], list[Any], Any]]) -> list[Any]:
        commands = [
            ("EVALSHA", SHAS[name], len(keys), *keys, *args) for name, keys, args, _ in batch
        ]
        for attempt in (1, 2):
            results = await self._execute(commands)
            if attempt == 2 or not any(
                isinstance(r, redis.exceptions.NoScriptError) for r in results
            ):
                return results
            # A new or restarted Redis: load the scripts, then once more.
            await self._execute([("SCRIPT", "LOAD", text) for text in SCRIPTS.values()])
        raise AssertionError("unreachable")

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` at once and read their replies; an error reply is returned, not raised."""
        if self.connection is None:
            self.connection = self.pool.make_connection()
        connection = self.connection
        try:
            await connection.send_packed_command(_resp(commands))
            results: list[Any] = []
            for _ in commands:
                try:
                    results.append(await connection.read_response())
                except redis.exceptions.ResponseError as exc:
                    results.append(exc)
            return results
        except BaseException:
            # The connection's state is unknown (a reply half read): the next round trip opens another.
            self.connection = None
            await connection.disconnect()
            raise


def _resp(commands: list[tuple[Any, ...]]) -> bytes:
    """``commands`` in Redis' wire format, as one buffer.

    The client's own packer (``pack_commands``) was a quarter of an accepted delivery's
    CPU (profiled: it encodes and checks each of a script's dozen arguments through
    several calls); the arguments here are only str, bytes and int.
    """
    parts: list[bytes] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


_batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = (
    weakref.WeakKeyDictionary()
)


def _event_problem(event: Any, remote_id: str) -> str:
    if not isinstance(event, dict):
        return "expected a JSON object"
    kinds = [key for key in event if key in EVENT_KINDS]
    if len(kinds) != 1 or not isinstance(event[kinds[0]], dict):
        return "expected exactly one of task, message, statusUpdate, artifactUpdate"
    payload = event[kinds[0]]
    task_id = payload.get("id") if kinds[0] == "task" else payload.get("taskId")
    if kinds[0] == "message" and task_id is None:
        return ""  # a message may name no task; record() decides
    if not isinstance(task_id, str) or not task_id:
        return "the notification names no task"
    if remote_id and task_id != remote_id:
        return "the notification is about another task than its config's"
    return ""


def _schedule_drain() -> None:
    from tasks_app.jobs import drain_push

    try:
        drain_push.delay()
    except Exception:  # the reconciler schedules it again within a tick
        _redis().delete(DRAIN_KEY)
        log.exception("could not schedule the push drain")


def schedule_if_waiting() -> bool:
    """Schedule a drain when notifications wait and none is scheduled (the reconciler's tick)."""
    r = _redis()
    if r.llen(QUEUE_KEY) and r.set(DRAIN_KEY, 1, nx=True, ex=60):
        _schedule_drain()
        return True
    return False


# Signed notifications -----------------------------------------------------------------------------

_jwks_cache: OrderedDict[str, tuple[float, jwt.PyJWKSet]] = OrderedDict()
_jwks_lock = threading.Lock()


class JWKSUnreadable(Exception):
    """The agent's key set could not be read; ``str()`` is the reason's class, never its text."""


def _fetch_jwks(url: str) -> jwt.PyJWKSet:
    """The key set at ``url``, through the outbound client (its guard, its limits).

    Bounded as any call to an agent: ``JWKS_DEADLINE_SECONDS`` for the whole fetch,
    ``JWKS_MAX_BYTES``, and the JSON's depth. Whatever goes wrong (the agent's keys are
    its own text) is one :class:`JWKSUnreadable`.
    """

    async def get(http: httpx.AsyncClient) -> bytes:
        async with (
            asyncio.timeout(JWKS_DEADLINE_SECONDS),
            http.stream("GET", url, timeout=JWKS_DEADLINE_SECONDS) as response,
        ):
            response.raise_for_status()
            data = b""
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > JWKS_MAX_BYTES:
                    raise ValueError("JWKS larger than 64 KB")
            return data

    try:
        keys = safejson.loads(outbound.run(get))
        if not isinstance(keys, dict):
            raise ValueError("the JWKS is not a JSON object")
        return jwt.PyJWKSet.from_dict({"keys": _public_keys(keys.get("keys"))})
    except Exception as exc:
        raise JWKSUnreadable(type(exc).__name__) from exc


# What a JWK of an agent may be, checked before any key is built: a private member made
# PyJWT recover the primes (pow() with the agent's numbers, holding the interpreter for
# seconds to minutes), a private key made verification raise; a huge modulus or exponent
# makes every signature check slow.
JWKS_MAX_KEYS = 32
PRIVATE_MEMBERS = ("d", "p", "q", "dp", "dq", "qi", "oth", "k")
RSA_MAX_MODULUS_CHARS = 1366  # base64url of 8,192 bits
RSA_MAX_EXPONENT_CHARS = 6  # base64url of 32 bits


def _public_keys(keys: Any) -> list[dict]:
    """The set's usable public keys (at most JWKS_MAX_KEYS); the others are left out."""
    if not isinstance(keys, list):
        raise ValueError("the JWKS has no list of keys")
    usable = []
    for key in keys[:JWKS_MAX_KEYS]:
        if not isinstance(key, dict) or any(name in key for name in PRIVATE_MEMBERS):
            continue
        if key.get("kty") == "RSA" and not (
            isinstance(key.get("n"), str)
            and isinstance(key.get("e"), str)
            and len(key["n"]) <= RSA_MAX_MODULUS_CHARS
            and len(key["e"]) <= RSA_MAX_EXPONENT_CHARS
        ):
            continue
        if key.get("kty") not in ("RSA", "EC", "OKP"):
            continue
        usable.append(key)
    if not usable:
        raise ValueError("the JWKS holds no usable public key")
    return usable


_jwks_failed: OrderedDict[str, tuple[float, JWKSUnreadable]] = OrderedDict()


_jwks_fetching: dict[str, threading.Lock] = {}


def _keyset(url: str, *, fresh: bool = False) -> jwt.PyJWKSet:
    """The agent's key set, cached; one fetch per URL at a time (concurrent deliveries that
    find it missing wait for that fetch instead of each holding a thread for their own)."""
    cached = _cached_keyset(url, fresh=fresh)
    if cached is not None:
        return cached
    with _jwks_lock:
        fetching = _jwks_fetching.setdefault(url, threading.Lock())
    with fetching:
        cached = _cached_keyset(url, fresh=fresh, since=time.monotonic() - JWKS_REFETCH_SECONDS)
        if cached is not None:
            return cached  # fetched by the delivery this one waited for
        try:
            keyset = _fetch_jwks(url)
        except JWKSUnreadable as exc:
            with _jwks_lock:
                # From the end of the failed fetch: a slow one must not leave no pause at all.
                _jwks_failed[url] = (time.monotonic(), exc)
                while len(_jwks_failed) > 256:
                    _jwks_failed.popitem(last=False)
            raise
        with _jwks_lock:
            _jwks_failed.pop(url, None)
            _jwks_cache[url] = (time.monotonic(), keyset)
            while len(_jwks_cache) > 256:
                _jwks_cache.popitem(last=False)
            if len(_jwks_fetching) > 256:
                _jwks_fetching.clear()  # held locks stay with their holders
        return keyset


def _cached_keyset(url: str, *, fresh: bool, since: float | None = None) -> jwt.PyJWKSet | None:
    """The cached set if still good (a fresh one asked for: fetched within JWKS_REFETCH_SECONDS,
    or after ``since``); raises the last failure within JWKS_FAILURE_SECONDS."""
    now = time.monotonic()
    with _jwks_lock:
        cached = _jwks_cache.get(url)
        failed = _jwks_failed.get(url)
    if cached is not None:
        age = now - cached[0]
        recent = since is not None and cached[0] >= since
        if age < settings.PUSH_JWKS_CACHE_SECONDS and (
            not fresh or age <= JWKS_REFETCH_SECONDS or recent
        ):
            return cached[1]
    if failed is not None and now - failed[0] < JWKS_FAILURE_SECONDS:
        raise failed[1]
    return None


def _key_for(url: str, kid: str | None) -> Any:
    for fresh in (False, True):
        keyset = _keyset(url, fresh=fresh)
        for key in keyset.keys:
            if kid is None or key.key_id == kid:
                return key.key
    return None


def verify_signed(config: _Config, token: str, body: bytes) -> tuple[str, str, int]:
    """Check a notification's signed token: (why not, or empty when good; its ``jti`` key;
    seconds to remember that key).

    The token (a JWS from the agent's JWKS) must name us as audience (the config's
    id) and the agent as issuer, be within its ``iat``/``exp`` (a small skew, and no
    longer a life than ``PUSH_JWT_MAX_LIFETIME_SECONDS``), carry the sha256 of this
    body (``request_body_sha256``), and its ``jti`` must be new: a replay is refused.
    The ``jti`` is taken by the queue script, with the delivery: one turned away for the
    config's rate (429) may be sent again, and of two copies at once one is a replay.
    """
    problem, jti_key, ttl = _verify_signed(config, token, body)
    return problem, ("" if problem else jti_key), ttl


def _verify_signed(config: _Config, token: str, body: bytes) -> tuple[str, str, int]:
    if not token:
        return "unsigned notification for a config that requires a signature", "", 0
    try:
        header = jwt.get_unverified_header(token)
        if header.get("alg") not in JWT_ALGORITHMS:
            return "signature algorithm not allowed", "", 0
        try:
            key = _key_for(config.jwks_url, header.get("kid"))
        except JWKSUnreadable as exc:
            return f"the agent's JWKS could not be read ({exc})", "", 0
        if key is None:
            return "signed with a key the agent's JWKS does not hold", "", 0
        claims = jwt.decode(
            token,
            key,
            algorithms=[header["alg"]],
            audience=config.config_id,
            issuer=config.jwt_issuer,
            leeway=settings.PUSH_JWT_SKEW_SECONDS,
            options={"require": ["iss", "aud", "iat", "exp", "jti"]},
        )
    except Exception as exc:
        # TypeError: a key of another type than the header's alg (an RS256 header on the
        # agent's EC key), which PyJWT reports only that way; whatever else a token and
        # the agent's keys make PyJWT raise. A refusal (401, counted), never an error of ours.
        return f"bad signed token: {type(exc).__name__}", "", 0
    issued, expires = _claim_time(claims.get("iat")), _claim_time(claims.get("exp"))
    if issued is None or expires is None:
        return "bad signed token: iat and exp must be times", "", 0
    if expires - issued > settings.PUSH_JWT_MAX_LIFETIME_SECONDS:
        return "signed token lives too long", "", 0
    if issued > time.time() + settings.PUSH_JWT_SKEW_SECONDS:
        return "signed token issued in the future", "", 0
    claimed = claims.get("request_body_sha256")
    if not isinstance(claimed, str) or not _same(claimed, hashlib.sha256(body).hexdigest()):
        return "signed token does not cover this body", "", 0
    jti_key = _jti_key(config, claims)
    if _redis().exists(jti_key):
        return "replayed signed token (jti seen before)", "", 0
    return "", jti_key, max(1, int(expires - time.time() + settings.PUSH_JWT_SKEW_SECONDS) + 1)


def _jti_key(config: _Config, claims: dict) -> str:
    return f"push:jti:{config.config_id}:{str(claims['jti'])[:200]}"


def _claim_time(value: Any) -> float | None:
    """A JWT time claim as seconds; None unless a finite number a float holds exactly."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not -(2**53) <= value <= 2**53:  # also NaN (fails both comparisons) and infinities
        return None
    return float(value)


# Draining the queue ------------------------------------------------------------------------------


def drain(*, max_seconds: float = 50.0) -> int:
    """Record what waits in the queue, batch by batch, then refresh the tasks it touched.

    Runs on the worker's shared loop (its database thread, its HTTP client). The
    drain flag is cleared when the queue is found empty, and the queue looked at
    once more after that, so a notification pushed in between is never stranded.
    """
    return eventloop.submit(_drain(max_seconds)).result()


# One drain records at a time: the scheduling flag (DRAIN_KEY) can lapse while a long drain
# runs, and the next delivery then schedules another. Two drains at once took a task's
# notifications in two batches and recorded them out of order (a lost artifact chunk).
RUNNING_KEY = "push:drain:running"
# Renewed at every batch and by the drain's heartbeat (``_keep_claim``) between: a drain
# killed lets the claim go after this. At 60 s (renewed per batch only) the queue waited a
# minute after a worker was killed, while streams were taken over in six seconds.
RUNNING_SECONDS = 15
HEARTBEAT_SECONDS = RUNNING_SECONDS / 3
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
WAIT_STEP_SECONDS = 0.2


async def _drain(max_seconds: float) -> int:
    """1. Take the running claim (waiting, within ``max_seconds``, for a drain that runs:
       what it leaves in the queue is this one's).
    2. Drain batch by batch, renewing the claim at each; a claim found lost (this drain
       stalled past RUNNING_SECONDS and another took over) ends this one at once.
    3. Give the claim back (only if still ours)."""
    r = _redis()
    deadline = time.monotonic() + max_seconds
    token = uuid.uuid4().hex
    while not await asyncio.to_thread(r.set, RUNNING_KEY, token, nx=True, ex=RUNNING_SECONDS):
        if time.monotonic() >= deadline:
            return 0  # the running drain looks at the queue once more before it stops
        await asyncio.sleep(WAIT_STEP_SECONDS)
    keeper = asyncio.ensure_future(_keep_claim(r, token))
    try:
        return await _drain_held(r, token, deadline)
    finally:
        keeper.cancel()
        await asyncio.to_thread(r.eval, _RELEASE, 1, RUNNING_KEY, token)


async def _keep_claim(r: redis.Redis, token: str) -> None:
    """While the drain runs, renew its claim every ``HEARTBEAT_SECONDS`` (a long batch keeps
    it), and keep the scheduling flag from outliving it: set for 60 s when the drain was
    scheduled, it would hold back the next drain that long after this one was killed. Stops
    when the claim is found lost (the drain itself notices at its next batch)."""
    try:
        await asyncio.to_thread(r.expire, DRAIN_KEY, RUNNING_SECONDS)
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            kept = await asyncio.to_thread(r.eval, _RENEW, 1, RUNNING_KEY, token, RUNNING_SECONDS)
            if not kept:
                return
            await asyncio.to_thread(r.expire, DRAIN_KEY, RUNNING_SECONDS)
    except redis.RedisError:
        return  # Redis away: the drain's own next call says so


async def _drain_held(r: redis.Redis, token: str, deadline: float) -> int:
    """Batch by batch: read the queue's head, record it, and only then take it off.

    A batch stays at the head of the queue until it is recorded: a worker killed (or a
    drain stopped) mid-batch leaves it there for the next drain, which records it again
    (a notification recorded already appends nothing; the push channel's entries equal to
    one in the log are the same delivery). Popped first, as before, such a batch was
    lost, with nothing in any task's log to say so.
    """
    total = 0
    while time.monotonic() < deadline:
        if not await asyncio.to_thread(r.eval, _RENEW, 1, RUNNING_KEY, token, RUNNING_SECONDS):
            log.warning("push drain: another drain took over (this one stalled); stopping")
            return total
        items = await asyncio.to_thread(_read_batch, r)
        if not items:
            # Off the loop, as every Redis call here: a Redis that hangs must not stall the
            # streams the loop holds.
            if await asyncio.to_thread(_cleared_and_empty, r):
                return total
            continue
        groups = _by_task(items, DRAIN_PARALLEL if eventloop.db_threads() > 1 else 1)
        touched: dict[int, str] = {}
        results = await asyncio.gather(
            *(eventloop.db(record_batch, group) for group in groups), return_exceptions=True
        )
        down = next((x for x in results if isinstance(x, OperationalError | InterfaceError)), None)
        if down is not None:
            # The database is down: the batch stays at the head of the queue, in order, for
            # the next drain (a group recorded already is recorded again: that appends nothing).
            await asyncio.to_thread(r.delete, DRAIN_KEY)
            log.warning("push drain: the database is unreachable (%s); %d notifications wait "
                        "for the next drain", type(down).__name__, len(items))  # fmt: skip
            return total
        error = next((x for x in results if isinstance(x, BaseException)), None)
        if error is not None:
            if isinstance(error, Exception):
                # Not the database: a batch that makes the recorder fail would fail every
                # drain after this one as well. It is taken off (logged as the error goes up).
                await asyncio.to_thread(_take_off, r, token, items)
            # Otherwise a call cancelled as the worker stops: the batch stays for the next drain.
            raise error
        for recorded in results:
            touched.update(recorded)
        total += len(items)
        _want_refresh(touched)
        if not await asyncio.to_thread(_take_off, r, token, items):
            log.warning("push drain: another drain took over (this one stalled); stopping")
            return total
        if DRAIN_GATHER_FROM <= len(items) < DRAIN_BATCH:
            await _gather(r, min(DRAIN_BATCH, DRAIN_GATHER_PER_TASK * len(touched)))
    # Out of time: the next drain goes on.
    await asyncio.to_thread(r.delete, DRAIN_KEY)
    await asyncio.to_thread(schedule_if_waiting)
    return total


# What one drain takes from the queue at once, in bytes (besides DRAIN_BATCH items): at a
# megabyte a notification, 5,000 of them were 5 GB in one worker.
DRAIN_BATCH_BYTES = 32 * 1024 * 1024


# The end of a batch, when less room is left than a delivery can weigh: items read one at a
# time from ARGV[1] (the batch's length so far) while they fit in ARGV[2] bytes (the first
# however large when ARGV[4] is 1: the batch is empty, and an item larger than the whole bound
# must still go through), at most ARGV[3]. A script, for one round trip instead of one per
# item; what it copies is bounded by the room left (a script copying 32 MB of items blocked
# Redis ten times as long as plain reads of them).
_READ_REST = """
local start, room, most, first = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local taken, bytes = {}, 0
while #taken < most do
  local item = redis.call('LINDEX', KEYS[1], start + #taken)
  if not item then break end
  local size = string.len(item)
  if bytes + size > room and not (first and #taken == 0) then break end
  taken[#taken + 1] = item
  bytes = bytes + size
end
return taken
"""


def _read_batch(r: redis.Redis) -> list[bytes]:
    """The next batch, read from the queue's head and left there (:func:`_take_off` takes it off
    once recorded): at most DRAIN_BATCH items and DRAIN_BATCH_BYTES bytes (an item larger
    than that alone is a batch of its own, so it still goes through).

    Only the drain that holds the running claim reads and takes off the head, and deliveries
    are pushed at the tail, so what it read is still the head when it takes it off.

    Sized by the queue's mean instead, a few large items ahead of many small ones made a
    200 MB batch. Read in chunks that cannot pass the bytes left: all that waits when the
    queue's byte count says it fits (one read, the usual case), else what fits at a
    delivery's largest, and the last of the room by _READ_REST. A chunk's surplus (an item
    larger than a delivery's largest, or a count gone wrong) is left for the next batch.
    """
    # What a queued delivery weighs at most: its body, the envelope _queued() adds and the
    # queue script's stamp.
    largest = settings.PUSH_MAX_BODY_BYTES + 96
    fits = int(r.get(QUEUE_BYTES_KEY) or 0) <= DRAIN_BATCH_BYTES
    items: list[bytes] = []
    taken = 0
    while len(items) < DRAIN_BATCH and taken < DRAIN_BATCH_BYTES:
        room, most = DRAIN_BATCH_BYTES - taken, DRAIN_BATCH - len(items)
        if not fits and room < largest:
            rest = r.eval(_READ_REST, 1, QUEUE_KEY, len(items), room, most, 0 if items else 1)
            items.extend(rest or [])
            break
        step = most if fits else min(most, room // largest)
        chunk = r.lrange(QUEUE_KEY, len(items), len(items) + step - 1)
        surplus = False
        for item in chunk:
            if items and taken + len(item) > DRAIN_BATCH_BYTES:
                surplus = True
                break
            items.append(item)
            taken += len(item)
        if surplus or len(chunk) < step or fits:
            break
    return items


# Take a recorded batch off the queue's head, with its bytes, while the running claim
# (KEYS[1]) is still ARGV[1]'s: a drain that stalled past its claim leaves the head to the
# drain that took over, which read the same batch and takes it off itself.
_TAKE_OFF = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('LTRIM', KEYS[2], tonumber(ARGV[2]), -1)
redis.call('DECRBY', KEYS[3], tonumber(ARGV[3]))
return 1
"""


_RESET_IF_EMPTY = (
    "if redis.call('LLEN', KEYS[1]) == 0 then redis.call('SET', KEYS[2], 0) end return 0"
)


def _take_off(r: redis.Redis, token: str, items: list[bytes]) -> bool:
    """Take ``items`` (what :func:`_read_batch` read) off the queue; False if the claim was lost."""
    size = sum(len(item) for item in items)
    return bool(
        r.eval(_TAKE_OFF, 3, RUNNING_KEY, QUEUE_KEY, QUEUE_BYTES_KEY, token, len(items), size)
    )


def _cleared_and_empty(r: redis.Redis) -> bool:
    """The queue looked empty: clear the drain flag, and look once more (a notification pushed
    in between would otherwise wait for no drain). False: go on draining (the flag is ours)."""
    r.delete(DRAIN_KEY)
    # Whatever a drain that died left counted, reset in one step with the look: looked at and
    # then reset, a delivery queued in between had its bytes wiped, and every later take-off
    # pushed the count below what the queue held (PUSH_QUEUE_MAX_BYTES loosened by as much).
    r.eval(_RESET_IF_EMPTY, 2, QUEUE_KEY, QUEUE_BYTES_KEY)
    return not (r.llen(QUEUE_KEY) and r.set(DRAIN_KEY, 1, nx=True, ex=60))


async def _gather(r: redis.Redis, enough: int) -> None:
    """A busy drain waits for the next batch to grow to ``enough`` (at most DRAIN_GATHER_SECONDS)."""
    deadline = time.monotonic() + DRAIN_GATHER_SECONDS
    while time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_GATHER_POLL_SECONDS)
        if await asyncio.to_thread(r.llen, QUEUE_KEY) >= enough:
            return


def _by_task(items: list[bytes], parts: int) -> list[list[bytes]]:
    """``items`` in at most ``parts`` groups, each task's notifications in one group (in order)."""
    if parts <= 1:
        return [items]
    groups: list[list[bytes]] = [[] for _ in range(parts)]
    for item in items:
        try:
            task_pk = int(json.loads(item)["t"])
        except (ValueError, KeyError, TypeError):
            task_pk = 0  # unreadable: record_batch says so
        groups[task_pk % parts].append(item)
    return [group for group in groups if group]


def record_batch(items: list[bytes]) -> dict[int, str]:
    """Record queued notifications, each task's in one ``record_many`` call.

    Returns the tasks recorded, with the state each is in now.
    """
    by_task: dict[int, list[tuple[int, int, Any]]] = {}
    for item in items:
        try:
            data = json.loads(item)
            # The queue script's stamp (0: queued before stamps, always counted).
            stamp = int(data.get("n", 0))
            by_task.setdefault(int(data["t"]), []).append((int(data["c"]), stamp, data["e"]))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("dropped an unreadable queued push notification")
    configs = {pk for entries in by_task.values() for pk, _, _ in entries}
    live = dict(
        PushConfig.objects.filter(pk__in=configs, deleted_at__isnull=True).values_list(
            "pk", "counted_through"
        )
    )
    now = timezone.now()
    counts: dict[int, int] = {}
    newest: dict[int, int] = {}
    touched: dict[int, str] = {}
    over_budget: set[int] = set()
    for task_pk, entries in by_task.items():
        objs = [obj for pk, _, obj in entries if pk in live]
        if not objs:
            continue
        try:
            result = record_many(task_pk, objs, "push")
        except RecordError as exc:
            log.warning("push notifications for task %s not recorded: %s", task_pk, exc)
            # A task still there lost them to contention (record_many gave up): they are off
            # the queue, so its log says so. A task deleted meanwhile has no log to tell.
            if RemoteTask.objects.filter(pk=task_pk).exists():
                _note_unrecorded(task_pk, len(objs), exc)
            continue
        except (OperationalError, InterfaceError):
            raise  # the database is down, not this task's fault: the drain puts the batch back
        except Exception as exc:  # one task's notifications must not lose the rest of the batch
            log.exception("push notifications for task %s not recorded", task_pk)
            _note_unrecorded(task_pk, len(objs), exc)
            continue
        touched[task_pk] = result.state
        if result.over_budget:
            over_budget.add(task_pk)
        for pk, stamp, _ in entries:
            # A stamp the config has counted already: this batch was recorded by a drain
            # killed before it took the batch off the queue (recording it again appended
            # nothing; counting it again counted every notification of it twice).
            if pk in live and (stamp == 0 or stamp > live[pk]):
                counts[pk] = counts.get(pk, 0) + 1
                newest[pk] = max(newest.get(pk, 0), stamp)
    if counts:  # one statement for the batch, not one per config
        PushConfig.objects.filter(pk__in=counts).update(
            last_received_at=now,
            received=F("received") + _by_config(counts),
            counted_through=Greatest(F("counted_through"), _by_config(newest)),
        )
    over = park_over_budget(over_budget)
    heard(set(touched) - over)
    return touched


def _by_config(values: dict[int, int]) -> Case:
    """``values[pk]`` for the row of each push config ``pk``, in an UPDATE of those rows."""
    whens = [When(pk=pk, then=Value(value)) for pk, value in values.items()]
    return Case(*whens, default=Value(0), output_field=models.BigIntegerField())


def park_over_budget(task_pks: set[int]) -> set[int]:
    """Tasks whose push notifications passed BUDGET_TASK_BYTES: parked ("needs attention").

    A holder parks a task over its budget (``watchers.Holder._judge``); nobody holds a task
    followed by push, so the drain does it, as the holder would (record() logged the one
    ``budget-exceeded`` entry; the hold-off is the parked recheck). Left "awaiting push",
    every dropped notification moved its hold-off on, so it never was. A task a holder has
    now is left to it; one abandoned, gone, settled or parked already is not touched.
    """
    if not task_pks:
        return set()
    from tasks_app.services.tasks import relay_watcher
    from tasks_app.watchers import PARKED_RECHECK_SECONDS

    Status = RemoteTask.WatcherStatus
    now = timezone.now()
    note = (
        f"needs attention: the task is over its storage budget "
        f"({settings.BUDGET_TASK_BYTES} bytes of agent content)"
    )
    free = Q(
        pk__in=task_pks,
        lease_token="",
        abandoned_at__isnull=True,
        gone_at__isnull=True,
        settled_at__isnull=True,
    ) & ~Q(watcher_status__in=[Status.PARKED, Status.ABANDONED, Status.GONE])
    RemoteTask.objects.filter(free).update(
        watcher_status=Status.PARKED,
        watcher_note=note[:500],
        watcher_since=now,
        lease_expires_at=now + timedelta(seconds=PARKED_RECHECK_SECONDS),
    )
    parked = set(
        RemoteTask.objects.filter(
            pk__in=task_pks, watcher_status=Status.PARKED, watcher_since=now
        ).values_list("pk", flat=True)
    )
    for pk in parked:
        relay_watcher(pk)
    return parked


def _note_unrecorded(task_pk: int, count: int, exc: Exception) -> None:
    """Say in the task's log that notifications were dropped (they were taken off the queue)."""
    note = f"{count} push notification(s) could not be recorded ({type(exc).__name__}); see the log"
    try:
        record_many(task_pk, [{"protocolError": {"message": note}}], "system")
    except Exception:  # saying so must not become a second failure
        log.warning("could not note the unrecorded notifications of task %s", task_pk)


_http: httpx.AsyncClient | None = None
# Per task (on the worker's loop): when notifications were first and last heard since the
# last GetTask, whether one said the task ended, and the coroutine that will refresh it.
_heard: dict[int, list[float]] = {}
_ended: set[int] = set()
_refreshers: dict[int, asyncio.Task[None]] = {}
# When each task's last refresh ended (loop time), for the PUSH_WINDOWS_KEPT latest tasks.
_refreshed_at: OrderedDict[int, float] = OrderedDict()
# The next GetTask's history window per task (``polls.window_for``), as a watcher keeps its
# own: without it every drained notification began at the first window, and a chatty agent's
# task cost two GetTasks each. A task forgotten here (the oldest go first) begins again there.
PUSH_WINDOWS_KEPT = 10_000
_windows: OrderedDict[int, int] = OrderedDict()


def _next_window(task_pk: int) -> int:
    return _windows.get(task_pk, POLL_HISTORY)


def _keep_window(task_pk: int, length: int) -> None:
    _keep(_windows, task_pk, length)


def _keep(kept: OrderedDict[int, Any], task_pk: int, value: Any) -> None:
    """Remember ``value`` for ``task_pk`` in ``kept``, for the PUSH_WINDOWS_KEPT latest tasks."""
    kept[task_pk] = value
    kept.move_to_end(task_pk)
    while len(kept) > PUSH_WINDOWS_KEPT:
        kept.popitem(last=False)


def _want_refresh(states: dict[int, str]) -> None:
    """Ask for a GetTask of each task, once its notifications pause (debounced).

    A GetTask made at once after each notification is often *ahead* of the
    notifications still in flight (the agent's next chunk is in its task before its
    push arrives): the late chunk then lands on a snapshot that already holds it.
    So the refresh waits until the task has been quiet for PUSH_REFRESH_DELAY_SECONDS
    (at most PUSH_REFRESH_MAX_WAIT_SECONDS after the first unrefreshed notification);
    a task that ended is refreshed, and settled, at once.
    """
    loop = asyncio.get_running_loop()
    now = loop.time()
    for task_pk, state in states.items():
        heard_at = _heard.setdefault(task_pk, [now, now])
        heard_at[1] = now
        if state in TERMINAL_STATES:
            _ended.add(task_pk)
        running = _refreshers.get(task_pk)
        if running is None or running.done():
            _refreshers[task_pk] = loop.create_task(_refresher(task_pk))


async def _refresher(task_pk: int) -> None:
    global _http
    loop = asyncio.get_running_loop()
    while True:
        first, last = _heard.get(task_pk, (loop.time(), loop.time()))
        due = min(
            last + settings.PUSH_REFRESH_DELAY_SECONDS,
            first + settings.PUSH_REFRESH_MAX_WAIT_SECONDS,
        )
        if task_pk in _ended:
            # At once, but not twice within the debounce: an agent that pushed an end its
            # GetTask did not show (working still, or failing) got a GetTask for every
            # notification after it, up to PUSH_RATE_PER_CONFIG a second, until a holder
            # settled the task.
            since = _refreshed_at.get(task_pk, -math.inf)
            wait = since + settings.PUSH_REFRESH_DELAY_SECONDS - loop.time()
        else:
            wait = due - loop.time()
        if wait <= 0:
            break
        await asyncio.sleep(wait)
    _heard.pop(task_pk, None)
    _ended.discard(task_pk)
    if _http is None:
        _http = outbound.new_http_client()
    try:
        await refresh_after_push(_http, task_pk)
    except Exception:  # one task's refresh must not stop the others
        log.exception("GetTask after push notifications for task %s failed", task_pk)
    finally:
        _keep(_refreshed_at, task_pk, loop.time())
        # Forgotten once done (the map grew by every push-watched task a worker ever saw);
        # notifications heard during this GetTask get a refresh of their own.
        if _refreshers.get(task_pk) is asyncio.current_task():
            del _refreshers[task_pk]
            if task_pk in _heard:
                _refreshers[task_pk] = loop.create_task(_refresher(task_pk))


async def refresh_after_push(http: httpx.AsyncClient, task_pk: int) -> None:
    """GetTask after a notification: recorded as a poll; an ended task is settled, its configs deleted."""
    task = await eventloop.db(
        lambda: RemoteTask.objects.select_related("agent").filter(pk=task_pk).first()
    )
    if (
        task is None
        or not task.remote_id
        or task.settled_at is not None
        or task.abandoned_at is not None
    ):
        return
    # A large reply keeps its slot until it is recorded (see a2a.large_body_scope).
    async with large_body_scope():
        try:
            client = outbound.client_for(task.agent, http)
            polled = await poll_task(client, task.remote_id, task_pk, _next_window(task_pk))
            _keep_window(task_pk, polled.next_length)
            snapshot = polled.task
        except A2AError as exc:
            log.info("GetTask after a push notification for task %s failed: %s", task_pk, exc)
            return
        ended = (snapshot.get("status") or {}).get("state") in TERMINAL_STATES
        # Settling (the fold of the agent's whole, final task) waits its turn as a watcher's
        # does: a hundred push tasks ending in the same second must not hold back the
        # events of the streams on this loop (``eventloop.later``).
        async with eventloop.later() if ended else contextlib.nullcontext():
            result = await eventloop.db(record, task_pk, {"task": snapshot}, "poll")
            if ended:
                await eventloop.db(
                    settle_if_ended,
                    task_pk,
                    snapshot,
                    note="reconciled with GetTask after a push notification",
                )
    if result.over_budget and not ended:
        await eventloop.db(park_over_budget, {task_pk})
    elif result.state == STATE_INPUT_REQUIRED:
        await eventloop.db(waiting_for_answer, {task_pk})  # as a pushed question leaves it
    if ended:
        # settle_if_ended also ended its "awaiting push" (no watcher would).
        _windows.pop(task_pk, None)
        async with eventloop.later(f"agent-{task.agent_id}"):  # as a watcher's settle does
            await forget_configs(client, task_pk, "deleted when the task settled")


# The task page: the agent's list, deleting one -------------------------------------------------


@dataclass
class Listing:
    """The task's configs as the agent lists them, matched with ours (no secret is kept)."""

    configs: list[dict[str, Any]]
    local: list[PushConfig]
    problem: str = ""
    # When the agent was asked (a listing is remembered for LISTING_REMEMBERED_SECONDS).
    listed_at: datetime | None = None


# Configs shown from the agent's list (its pages may hold 32 MB each): a page, not a book.
MAX_LISTED_CONFIGS = 200
LISTED_PAGES = 10
LISTING_SECONDS = 15.0  # the whole listing (a page view waits for it)
LISTING_MAX_BYTES = 1024 * 1024  # one page of the agent's list
# Each view of a push-followed task's page lists its configs at the agent, with the agent's
# credentials: a reader reloading the page made a call (up to LISTED_PAGES) each time. The
# agent's answer is remembered this long, per task and per state of our own configs (so a
# config we register or delete shows at once); the page says when the agent was asked.
LISTING_REMEMBERED_SECONDS = 30


def list_at_agent(task: RemoteTask) -> Listing:
    """The task's configs at the agent (at most ``LISTED_PAGES`` pages, ``MAX_LISTED_CONFIGS``
    configs), each marked as ours or not."""
    local = list(task.push_configs.order_by("created_at"))
    if not task.remote_id:
        return Listing([], local, "the agent has not named the task yet")
    if not task.agent.push:
        return Listing([], local, f"{task.agent.name} does not declare push notifications")
    ours = {config.config_id: config for config in local}
    key = _listing_key(task, local)
    remembered = _remembered_listing(key)
    if remembered is None:
        listed_at = timezone.now()
        configs, problem = _read_listing(task)
        _remember_listing(key, configs, problem, listed_at)
    else:
        configs, problem, listed_at = remembered
    rows = []
    for c in configs:
        config_id = str(c.get("id", ""))
        shown = config_id[:200]
        rows.append(
            {
                "id": shown,
                "url": str(c.get("url", ""))[:1000],
                "ours": config_id in ours,
                # The delete form's URL holds the id as one path segment: an empty id, or
                # one with a "/", has no such URL (the page answered 500); no button then.
                "deletable": bool(shown) and "/" not in shown,
            }
        )
    return Listing(rows, local, problem, listed_at)


def _read_listing(task: RemoteTask) -> tuple[list[dict[str, Any]], str]:
    """The agent's configs for ``task`` as shown (ids and URLs, cut), and what to say of them."""
    cut = ""

    async def call(http: httpx.AsyncClient) -> list[dict[str, Any]]:
        nonlocal cut
        client = outbound.client_for(
            task.agent, http, max_response_bytes=LISTING_MAX_BYTES, timeout=LISTING_SECONDS
        )
        found: list[dict[str, Any]] = []
        token = ""
        try:
            async with asyncio.timeout(LISTING_SECONDS):  # the whole listing, not per page
                for _ in range(LISTED_PAGES):  # an agent that pages forever is cut off here
                    page = await client.list_push_configs(task.remote_id, page_token=token or None)
                    # Kept as shown (a config of megabytes is not held for the page).
                    found.extend(
                        {"id": str(c.get("id", ""))[:300], "url": str(c.get("url", ""))[:1000]}
                        for c in page["configs"][: MAX_LISTED_CONFIGS + 1]
                        if isinstance(c, dict)
                    )
                    token = page.get("nextPageToken") or ""
                    if not token or len(found) > MAX_LISTED_CONFIGS:
                        break
        except TimeoutError:
            if not found:
                raise A2AError(f"no answer within {LISTING_SECONDS:.0f} s") from None
            cut = f"the agent's list took longer than {LISTING_SECONDS:.0f} s: what came is shown"
        return found

    try:
        configs = outbound.run(call)
    except A2AError as exc:
        return [], f"the agent's list could not be read: {exc}"
    if len(configs) > MAX_LISTED_CONFIGS:
        return configs[:MAX_LISTED_CONFIGS], (
            f"the agent lists more configs for this task: the first {MAX_LISTED_CONFIGS} are shown"
        )
    return configs, cut


def _listing_key(task: RemoteTask, local: list[PushConfig]) -> str:
    """The task (its creation time too: a pk can be used again after a rollback), where the
    agent is asked, and the state of our own configs there."""
    ours = "|".join(f"{c.config_id}:{c.registered_at}:{c.deleted_at}" for c in local)
    state = f"{task.created_at.isoformat()}|{task.remote_id}|{task.agent.interface_url}|{ours}"
    return f"push-listing:{task.pk}:{hashlib.sha256(state.encode()).hexdigest()[:32]}"


def _forget_listing(task: RemoteTask) -> None:
    local = list(task.push_configs.order_by("created_at"))
    with contextlib.suppress(redis.RedisError):
        shared_redis.client(settings.REDIS_URL).delete(_listing_key(task, local))


def _remembered_listing(key: str) -> tuple[list[dict[str, Any]], str, datetime] | None:
    try:
        value = shared_redis.client(settings.REDIS_URL).get(key)
    except redis.RedisError:
        return None  # Redis down: the agent is asked, as before
    if value is None:
        return None
    data = json.loads(value)
    return data["configs"], data["problem"], datetime.fromisoformat(data["at"])


def _remember_listing(
    key: str, configs: list[dict[str, Any]], problem: str, listed_at: datetime
) -> None:
    value = json.dumps({"configs": configs, "problem": problem, "at": listed_at.isoformat()})
    with contextlib.suppress(redis.RedisError):
        shared_redis.client(settings.REDIS_URL).set(key, value, ex=LISTING_REMEMBERED_SECONDS)


def delete_config(task: RemoteTask, config_id: str, *, actor_id: int | None = None) -> str:
    """Delete one config at the agent (and ours, if it is ours); the log says who did it.

    Returns what the agent answered when it refused to delete one of ours (deleted here
    anyway), else "".
    """
    from tasks_app.access import Perm, require
    from tasks_app.services.tasks import TaskActionError

    require(actor_id, task.agent.project_id, Perm.OPERATE)
    if not task.remote_id:
        raise TaskActionError("The agent has not named this task yet.")

    async def call(http: httpx.AsyncClient) -> None:
        await outbound.client_for(task.agent, http).delete_push_config(task.remote_id, config_id)

    refused: A2AError | None = None
    try:
        outbound.run(call)
    except A2AError as exc:
        refused = exc
    # Only this task's own config is forgotten by the webhook: the id comes from the URL, and
    # another task's (another project's) config must keep taking its deliveries. Ours is
    # deleted whatever the agent answered: an agent that refuses (or says it has no such
    # config) must not keep its pushes coming.
    ours = PushConfig.objects.filter(task=task, config_id=config_id, deleted_at__isnull=True)
    note = "deleted by an operator" + (" (the agent refused)" if refused else "")
    if ours.update(deleted_at=timezone.now(), deleted_note=note):
        forget_cached(config_id)
        refused_ours = refused
        refused = None
    else:
        refused_ours = None
    if refused is not None:
        raise TaskActionError(f"The agent did not delete the push config: {refused}") from None
    record(
        task,
        {"operator": {"action": "delete-push-config", "config": config_id[:200],
                      **({"agent": str(refused_ours)[:300]} if refused_ours else {})}},
        "operator",
        actor_id=actor_id,
    )  # fmt: skip
    _polled_without_configs(task, actor_id)
    _forget_listing(task)  # an agent's own config deleted changes none of ours: the key stays
    return str(refused_ours) if refused_ours else ""


def _polled_without_configs(task: RemoteTask, actor_id: int | None) -> None:
    """A task followed by push whose last config was deleted is polled from now on: it said
    "awaiting push notifications" that nothing would send, until its silence ran out."""
    from tasks_app.services.tasks import TaskActionError, switch_watch

    task.refresh_from_db()
    if task.watch != RemoteTask.Watch.PUSH:
        return
    if PushConfig.objects.filter(task=task, deleted_at__isnull=True).exists():
        return
    # Ended, abandoned or gone: nothing to follow. Switched by someone else since the read
    # above: their choice stands.
    with contextlib.suppress(TaskActionError):
        switch_watch(
            task, RemoteTask.Watch.POLL, actor_id=actor_id, only_from=RemoteTask.Watch.PUSH
        )
