"""Proving the log: the hash chain verifies, and a replay of the log equals the view.

* :func:`verify` recomputes every row's hash (``tasks_app.services.chain``) in
  seq order and names the first row that does not match, or the first seq
  missing from the log.
* :func:`replay` folds the stored log from scratch, through ``record()`` itself,
  into a scratch task inside a transaction that is always rolled back, and
  compares the result with the stored view. Equal means the view is exactly
  what the log says (the log is the truth); a difference names the field.

Both are read-only for the mirror; ``manage.py audit verify|replay`` and the
task and event-log pages call them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from django.conf import settings
from django.db import transaction

from tasks_app.models import Agent, RemoteTask, Surface, TaskEvent
from tasks_app.runtime import shared_redis
from tasks_app.services.chain import content_digest, event_hash
from tasks_app.services.snapshot import task_view
from tasks_app.services.surfaces import FOLDED

# Above this many rows the pages do not verify on every load (a link does it on request).
VERIFY_ON_PAGE_MAX_ROWS = 2000
# ... or above this many bytes of agent content: reading them on every load grows the web process.
VERIFY_ON_PAGE_MAX_BYTES = 4 * 1024 * 1024
BATCH = 1000

log = logging.getLogger(__name__)


@dataclass
class Verification:
    """The outcome of checking one task's chain."""

    task_pk: int
    rows: int = 0
    broken_seq: int | None = None
    reason: str = ""
    # The head (last_seq, last_hash) this check read; a page remembers the outcome by it.
    head: tuple[int, str] | None = None
    # Set when the outcome is a remembered one (``verify_on_request``): when it was found.
    checked_at: datetime | None = None
    # Set when the chain was not checked now, and why (busy, over the person's allowance).
    not_checked: str = ""

    @property
    def ok(self) -> bool:
        return self.broken_seq is None and not self.reason and not self.not_checked

    def __str__(self) -> str:
        if self.not_checked:
            return f"task {self.task_pk}: chain not checked now: {self.not_checked}"
        if self.ok:
            return f"task {self.task_pk}: chain verifies ({self.rows} rows)"
        where = f" at seq {self.broken_seq}" if self.broken_seq is not None else ""
        return f"task {self.task_pk}: chain broken{where}: {self.reason}"


def verify(task: RemoteTask | int) -> Verification:
    """Recompute the chain of one task's log; the first row that does not match breaks it.

    The task may be recording while this runs. ``record()`` commits a task's new rows and
    its ``last_seq``/``last_hash`` together, so the head is read first and only the rows
    it counts are checked: rows committed later are not mistaken for a broken chain.

    1. Read the head (``last_seq``, ``last_hash``).
    2. Read the rows up to ``last_seq`` in seq order, a batch at a time (constant memory).
    3. Each seq must be the one after the previous (no gap, no duplicate).
    4. Each row's hash must equal sha256(previous hash + canonical form), with the raw
       content's digest recomputed from what is stored.
    5. The last row must be seq ``last_seq`` with hash ``last_hash``.
    6. A row after ``last_seq`` breaks the chain only while the head still says
       ``last_seq``; had it moved, the row came with a later commit.
    """
    task_pk = task if isinstance(task, int) else task.pk
    result = Verification(task_pk)
    head = _head(task_pk)
    if head is None:
        result.reason = "the task does not exist"
        return result
    last_seq, last_hash = head
    result.head = head
    previous_hash, expected_seq = "", 1
    for event in _rows(task_pk, up_to=last_seq):
        if event.seq != expected_seq:
            result.broken_seq = expected_seq
            result.reason = f"row {expected_seq} is missing (next stored row is {event.seq})"
            return result
        digest, _ = content_digest(event.raw)
        if event_hash(previous_hash, event, digest) != event.hash:
            result.broken_seq = event.seq
            result.reason = "the row's content does not match its hash"
            return result
        previous_hash = event.hash
        expected_seq += 1
        result.rows += 1
    if last_seq != result.rows:
        result.broken_seq = result.rows + 1
        result.reason = f"the task counts {last_seq} rows, the log holds {result.rows}"
    elif last_hash != previous_hash:
        result.broken_seq = result.rows or None
        result.reason = "the task's newest hash is not the last row's"
    else:
        beyond = (
            TaskEvent.objects.filter(task_id=task_pk, seq__gt=last_seq)
            .order_by("seq")
            .values_list("seq", flat=True)
            .first()
        )
        if beyond is not None and _head(task_pk) == head:
            result.broken_seq = beyond
            result.reason = f"the task counts {last_seq} rows, the log holds row {beyond} too"
    return result


def _head(task_pk: int) -> tuple[int, str] | None:
    """The task's newest seq and hash, as ``record()`` last committed them."""
    return RemoteTask.objects.filter(pk=task_pk).values_list("last_seq", "last_hash").first()


def verify_for_page(task: RemoteTask) -> Verification | None:
    """The chain's state for a page, or None when the log is too large to check on every load."""
    if task.last_seq > VERIFY_ON_PAGE_MAX_ROWS or task.stored_bytes > VERIFY_ON_PAGE_MAX_BYTES:
        return None
    return verify(task)


# Verifying on request (the pages' "verify now") ----------------------------------------------
#
# A full check of a long log reads every row: 100,000 rows (64 MiB) took 2.9 s (SQLite) and
# 3.6 s (PostgreSQL) of a web process, and any reader could ask for it on every load, many at
# once. Now (shared by every web process through Redis):
# * an outcome is remembered by the task's head (last_seq, last_hash) for
#   CHAIN_VERIFY_REMEMBER_SECONDS: asked again while the log has not grown, it costs one
#   Redis read, and the page says when it was checked;
# * one check per task runs at once, and one per person: a second asker is told one runs;
# * a person starts at most CHAIN_VERIFY_PER_PERSON_PER_HOUR checks an hour.
# Claims are compare-and-set (SET NX with an expiry, so a killed process frees them).

VERIFY_CLAIM_SECONDS = 600  # longest a claim is held (a check of the largest log takes seconds)
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


def _remembered_key(task_pk: int) -> str:
    return f"chain-verified:{task_pk}"


def remembered(task: RemoteTask) -> Verification | None:
    """The remembered outcome for the task's current head, or None (none, expired, Redis down)."""
    try:
        value = shared_redis.client(settings.REDIS_URL).get(_remembered_key(task.pk))
    except redis.RedisError:
        return None
    if value is None:
        return None
    try:
        kept = json.loads(value)
        if (kept["last_seq"], kept["last_hash"]) != (task.last_seq, task.last_hash):
            return None  # the log grew (or the head changed): check again
        return Verification(
            task.pk,
            rows=int(kept["rows"]),
            broken_seq=kept["broken_seq"],
            reason=str(kept["reason"]),
            head=(task.last_seq, task.last_hash),
            checked_at=datetime.fromtimestamp(float(kept["at"]), UTC),
        )
    except (ValueError, KeyError, TypeError):
        return None


def _remember(result: Verification) -> None:
    if result.head is None:
        return
    value = json.dumps(
        {"last_seq": result.head[0], "last_hash": result.head[1], "rows": result.rows,
         "broken_seq": result.broken_seq, "reason": result.reason, "at": time.time()}
    )  # fmt: skip
    seconds = max(1, int(settings.CHAIN_VERIFY_REMEMBER_SECONDS))
    try:
        shared_redis.client(settings.REDIS_URL).set(
            _remembered_key(result.task_pk), value, ex=seconds
        )
    except redis.RedisError:
        log.warning("could not remember the chain check of task %s", result.task_pk)


def verify_on_request(task: RemoteTask, person_id: int, *, again: bool = False) -> Verification:
    """What a page's "verify now" shows: a remembered outcome, a fresh check, or why not now.

    ``again`` ("check again"): a fresh check even when an outcome is remembered. The head
    names a log that did not grow, not one whose earlier rows nobody changed since; only
    a new check (with the same claims and hourly count) sees such a change.
    """
    found = None if again else remembered(task)
    if found is not None:
        return found
    r = shared_redis.client(settings.REDIS_URL)
    token = secrets.token_hex(8)
    task_key, person_key = f"chain-verifying:{task.pk}", f"chain-verifying-person:{person_id}"
    claimed: list[str] = []
    try:
        if not r.set(task_key, token, nx=True, ex=VERIFY_CLAIM_SECONDS):
            return Verification(task.pk, not_checked=(
                "a check of this log is running now (asked by someone else); reload in a "
                "moment to see its outcome"))  # fmt: skip
        claimed.append(task_key)
        if not r.set(person_key, token, nx=True, ex=VERIFY_CLAIM_SECONDS):
            return Verification(task.pk, not_checked=(
                "you have a check of another log running; one runs at a time per person"))  # fmt: skip
        claimed.append(person_key)
        hour = int(time.time() // 3600)
        count_key = f"chain-verify-count:{person_id}:{hour}"
        pipe = r.pipeline()
        pipe.incr(count_key)
        pipe.expire(count_key, 3600)
        count = pipe.execute()[0]
        allowed = settings.CHAIN_VERIFY_PER_PERSON_PER_HOUR
        if count > allowed:
            return Verification(task.pk, not_checked=(
                f"you have asked for {allowed} checks of long logs this hour, the most one "
                "person may; try again after the hour"))  # fmt: skip
        result = verify(task)
        _remember(result)
        return result
    except redis.RedisError as exc:
        log.warning("chain check of task %s not run: Redis: %s", task.pk, type(exc).__name__)
        return Verification(task.pk, not_checked=(
            "the shared store that coordinates checks is unreachable; try again later"))  # fmt: skip
    finally:
        for key in claimed:
            with contextlib.suppress(redis.RedisError):  # it expires on its own
                r.eval(_RELEASE, 1, key, token)


# Replay -----------------------------------------------------------------------------------------


@dataclass
class Replay:
    task_pk: int
    rows: int = 0
    differences: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def __str__(self) -> str:
        if self.ok:
            return f"task {self.task_pk}: replay of {self.rows} rows equals the view"
        return f"task {self.task_pk}: replay differs: " + "; ".join(self.differences)


class _Rollback(Exception):
    pass


def view_of(task: RemoteTask) -> dict[str, Any]:
    """What the log determines about a task: the A2A view plus the mirror's own facts."""
    return {
        "task": task_view(task),
        "phase": task.phase,
        "settled": task.settled_at is not None,
        "interrupted_question": task.asked_seq > 0,
        "surfaces": surfaces_view(task),
    }


def surfaces_view(task: RemoteTask) -> list[dict[str, Any]]:
    """The task's A2UI surfaces as the log determines them (not the actions people took)."""
    return [
        {"surface_id": surface.surface_id, **{name: getattr(surface, name) for name in FOLDED}}
        for surface in Surface.objects.filter(task=task).order_by("surface_id")
    ]


def replay(task: RemoteTask | int) -> Replay:
    """Fold the stored log from scratch and compare it with the stored view.

    The task may be recording while this runs, so everything is read in one snapshot
    (:func:`_one_snapshot`): a row committed between reading the log and reading the view
    would otherwise show as a difference.

    1. In a transaction that is always rolled back, read the stored log's kinds and the
       stored view's task, then make a scratch agent and a scratch task that starts as
       every task starts (nothing known).
    2. Feed every stored row, in seq order and on its own channel, to
       ``record_many()`` (runs of rows on one channel together), with big part
       contents the log keeps by reference put back from the part rows. ``gap``
       rows are left out: the fold writes them itself where it finds a difference.
    3. The rows the replay appends, gaps left out, must have the same kinds and
       states as the stored ones; the scratch view must equal the stored view.

    An entry refused because another row of the agent mirrored the task it named
    (``record.MIRRORED_ELSEWHERE``) is refused again: the scratch agent gets a row for
    each such id first. It had none, and the replay took the task as this one's.
    """
    from tasks_app.services.record import (
        MIRRORED_ELSEWHERE,
        as_it_came,
        named_task_id,
        record_many,
        references_in,
        stored_contents,
    )

    task_pk = task.pk if isinstance(task, RemoteTask) else task
    result = Replay(task_pk)
    try:
        with _one_snapshot():
            stored = RemoteTask.objects.get(pk=task_pk)
            expected = [
                (kind, state)
                for kind, state in stored.events.order_by("seq").values_list("kind", "state_after")
                if kind != TaskEvent.Kind.GAP
            ]
            contents = stored_contents(stored.pk)
            looked_below = settings.INLINE_CONTENT_BYTES  # contents read: those longer than this
            agent = Agent.objects.create(
                name="replay", base_url=f"http://replay.invalid/{uuid.uuid4().hex}"
            )
            scratch = RemoteTask.objects.create(
                agent=agent, mode=stored.mode, watch=stored.watch, phase=RemoteTask.Phase.SENDING
            )
            refused = stored.events.filter(
                kind=TaskEvent.Kind.PROTOCOL_ERROR, note__contains=MIRRORED_ELSEWHERE
            ).values_list("raw", flat=True)
            for remote_id in {named_task_id(raw) for raw in refused} - {None, stored.remote_id}:
                RemoteTask.objects.create(
                    agent=agent, remote_id=remote_id, phase=RemoteTask.Phase.TASK, title="replay"
                )
            run: list[Any] = []
            # A run is one recording call's rows (one time): the fold judges a status's time
            # against the time it was received (``record_many``'s ``at``).
            run_key: tuple[str, int | None, Any] | None = None
            for event in _rows(stored.pk):
                if event.kind == TaskEvent.Kind.GAP:
                    continue
                key = (event.channel, event.actor_id, event.received_at)
                if run and key != run_key:
                    record_many(scratch.pk, run, run_key[0], actor_id=run_key[1], at=run_key[2])  # type: ignore[index]
                    run = []
                run_key = key
                referred = references_in(event.raw)
                missing = {sha: chars for sha, chars in referred.items() if sha not in contents}
                if missing:
                    # Referred to under a lower INLINE_CONTENT_BYTES than today's: shorter.
                    shortest = max(0, min(missing.values()) - 1)
                    if shortest < looked_below:
                        contents.update(stored_contents(stored.pk, shortest))
                        looked_below = shortest
                # Only a row that refers is put back (and hashed again to check it).
                run.append(as_it_came(event.raw, event.digest, contents) if referred else event.raw)
                result.rows += 1
            if run and run_key is not None:
                record_many(scratch.pk, run, run_key[0], actor_id=run_key[1], at=run_key[2])
            scratch.refresh_from_db()
            replayed = [
                (kind, state)
                for kind, state in scratch.events.order_by("seq").values_list("kind", "state_after")
                if kind != TaskEvent.Kind.GAP
            ]
            if replayed != expected:
                first = next(
                    (i for i, (a, b) in enumerate(zip(replayed, expected, strict=False)) if a != b),
                    min(len(replayed), len(expected)),
                )
                result.differences.append(
                    f"log entry {first + 1} (gaps left out) replays as "
                    f"{replayed[first] if first < len(replayed) else 'nothing'}, stored as "
                    f"{expected[first] if first < len(expected) else 'nothing'}"
                )
            mine, theirs = view_of(scratch), view_of(stored)
            for key in mine:
                if mine[key] != theirs[key]:
                    result.differences.append(
                        f"{key}: replayed {mine[key]!r} != stored {theirs[key]!r}"[:2000]
                    )
            raise _Rollback
    except _Rollback:
        pass
    return result


@contextmanager
def _one_snapshot() -> Iterator[None]:
    """A transaction whose reads all see the database as of one moment.

    SQLite's transactions start with ``BEGIN IMMEDIATE`` here (settings), so no other
    writer commits until this one ends. PostgreSQL's default, READ COMMITTED, gives each
    statement its own snapshot; REPEATABLE READ gives the whole transaction one. It can
    only be set as a transaction's first statement, so a call nested in another
    transaction (a test's) keeps the outer one's level.
    """
    connection = transaction.get_connection()
    outermost = not connection.in_atomic_block
    with transaction.atomic():
        if outermost and connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        yield


def _rows(task_pk: int, up_to: int | None = None) -> Iterator[TaskEvent]:
    """A task's log in seq order (up to seq ``up_to``), a batch at a time (constant memory)."""
    after = 0
    rows_of_task = TaskEvent.objects.filter(task_id=task_pk)
    if up_to is not None:
        rows_of_task = rows_of_task.filter(seq__lte=up_to)
    while True:
        rows = list(rows_of_task.filter(seq__gt=after).order_by("seq")[:BATCH])
        yield from rows
        if len(rows) < BATCH:
            return
        after = rows[-1].seq
