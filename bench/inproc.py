"""Rows measured in-process against the (scratch) database: P3, P4, P5.

These run inside :mod:`bench.child`, whose settings already point at a
migrated scratch database and a private Redis. Recording goes through the real
``record_many()`` with the relay on, the way a worker does it: the process's
shared loop (``tasks_app.eventloop``) is started, so ``relay.publish()`` queues to
the one relay coroutine, and a channel-layer listener in a process of its own
(``bench.listen``, standing for the web process) counts what reaches the
task's group - a row only counts as relayed when it arrived.
"""

from __future__ import annotations

import datetime as dt
import gc
import itertools
import json
import statistics
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connection, transaction

from bench.report import Row

BATCH = 100  # events per record_many() call: what a fast stream queues while one commit runs


# Fixtures -----------------------------------------------------------------------------------


def make_agent(name: str = "bench") -> Any:
    from tasks_app.models import Agent

    return Agent.objects.create(
        name=name,
        base_url=f"http://127.0.0.1:9/{name}-{uuid.uuid4().hex[:8]}",
        interface_url="http://127.0.0.1:9/jsonrpc",
        binding="JSONRPC",
        protocol_version="1.0",
        streaming=True,
    )


def make_task(agent: Any, title: str = "bench") -> Any:
    from tasks_app.models import RemoteTask

    return RemoteTask.objects.create(
        agent=agent,
        remote_id=f"remote-{uuid.uuid4().hex}",
        context_id=f"ctx-{uuid.uuid4().hex[:8]}",
        title=title,
        phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING",
        # A held timestamp, so each later-stamped statusUpdate is news (same state, no
        # timestamp held would make record() treat them as repeats of the held status).
        status_timestamp=T0 - dt.timedelta(seconds=1),
        watch=RemoteTask.Watch.STREAM,
    )


T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def status_event(task: Any, i: int) -> dict:
    ts = (T0 + dt.timedelta(milliseconds=i)).isoformat().replace("+00:00", "Z")
    return {
        "statusUpdate": {
            "taskId": task.remote_id,
            "contextId": task.context_id,
            "status": {"state": "TASK_STATE_WORKING", "timestamp": ts},
            "metadata": {"i": i},
        }
    }


def chunk_event(task: Any, i: int, artifact_id: str = "out") -> dict:
    return {
        "artifactUpdate": {
            "taskId": task.remote_id,
            "contextId": task.context_id,
            "artifact": {
                "artifactId": artifact_id,
                "parts": [{"text": f"chunk {i:06d} " + "x" * 48}],
            },
            "append": i > 0,
            "lastChunk": False,
        }
    }


def mixed_events(task: Any, n: int) -> list[dict]:
    """A fast stream: status updates and artifact chunks, alternating."""
    return [status_event(task, i) if i % 2 == 0 else chunk_event(task, i) for i in range(n)]


# Relay listener -------------------------------------------------------------------------------


def relayed_events(message: dict) -> list[dict]:
    """The log rows one channel-layer message carries: ``task.event`` (one) or ``task.events`` (a run)."""
    if message.get("type") == "task.event":
        return [message]
    if message.get("type") == "task.events":
        return [e for e in message.get("events") or [] if isinstance(e, dict)]
    return []


class RelayCounter:
    """Counts what reaches ``task-<pk>``, in a listener process of its own (``bench.listen``).

    The listener stands for the web process a browser is connected to: in a
    deployment the worker records and relays, and another process receives. A
    listener inside the recording process would take the interpreter lock from
    the recorder to decode every message, and charge that to record().
    """

    def __init__(self, task_pk: int, expected: int, timeout: float) -> None:
        from tasks_app import relay

        self.count = 0
        self.last_at = 0.0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.listen", relay.task_group(task_pk), str(expected),
             str(timeout)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "READY":
            self.close()
            raise RuntimeError("the relay listener did not start")

    def wait(self) -> None:
        """Until the listener has its count, or its timeout passed: its count and last arrival."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("DONE "):
                _, count, last_at = line.split()
                self.count, self.last_at = int(count), float(last_at)
                break
        self.process.wait(10)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_worker_loop() -> None:
    """Start the shared loop as a worker does, so relays go through the one relay coroutine."""
    from tasks_app import eventloop

    eventloop.get_loop()


# P3 -------------------------------------------------------------------------------------------


def record_as_a_watcher(task: Any, events: list[dict]) -> None:
    """Record ``events`` as a watcher's pump does a fast stream's: it takes ``BATCH`` events
    from the stream's queue at a time and records them in calls of ``RECORD_CALL_EVENTS``
    (this module's ``BATCH``), each call given the next one of the same take as ``ahead``
    (parsed and folded while it waits on the database)."""
    from tasks_app.services.record import Batch, record_many
    from tasks_app.watchers import BATCH as TAKE
    from tasks_app.watchers import RECORD_CALL_EVENTS

    assert RECORD_CALL_EVENTS == BATCH, "the floor writes in transactions of one call's events"
    for take in range(0, len(events), TAKE):
        taken = events[take : take + TAKE]
        calls = [
            Batch(taken[start : start + RECORD_CALL_EVENTS])
            for start in range(0, len(taken), RECORD_CALL_EVENTS)
        ]
        for call, ahead in itertools.zip_longest(calls, calls[1:]):
            record_many(task.pk, call, "stream", ahead=ahead)


def record_stream(task: Any, events: list[dict]) -> tuple[float, float, int]:
    """Record ``events`` as a watcher does (:func:`record_as_a_watcher`), wait until all
    are relayed.

    Returns (seconds until recorded, seconds until relayed, relayed count).
    """
    counter = RelayCounter(task.pk, len(events), timeout=30 + len(events) / 500)
    try:
        t0 = time.monotonic()
        record_as_a_watcher(task, events)
        recorded = time.monotonic() - t0
        counter.wait()
        relayed = (counter.last_at - t0) if counter.count else float("nan")
        return recorded, max(relayed, recorded), counter.count
    finally:
        counter.close()


def rows_floor(source: Any, target: Any, batch: int = BATCH) -> float:
    """The floor: the rows record() wrote for ``source``, written again for ``target`` in bulk.

    The same log rows, artifact parts, messages, artifact updates and snapshot
    update, read back from what record() stored, are written by the same bulk
    inserts record_many() uses (``insert_rows``) and plain updates, in one
    transaction per batch of ``batch`` log rows: what the database costs for the
    same writes, without parsing, folding, hashing, reading the snapshot or
    relaying. The rows are built, and the artifact rows created, before the clock
    starts.
    """
    from tasks_app.models import Artifact, ArtifactPart, ConversationMessage, RemoteTask, TaskEvent
    from tasks_app.services.record import insert_rows, relax_commit

    events = list(TaskEvent.objects.filter(task_id=source.pk).order_by("seq"))
    parts = list(ArtifactPart.objects.filter(artifact__task_id=source.pk).order_by("seq", "index"))
    messages = list(ConversationMessage.objects.filter(task_id=source.pk).order_by("seq"))
    final = RemoteTask.objects.get(pk=source.pk)
    snapshot = {
        name: getattr(final, name)
        for name in ("state", "status_message", "status_timestamp", "metadata", "stored_bytes")
    }
    made = {
        a.pk: Artifact.objects.create(
            task_id=target.pk, artifact_id=a.artifact_id, position=a.position, digest=a.digest
        )
        for a in Artifact.objects.filter(task_id=source.pk)
    }
    for row in (*events, *messages):
        row.pk, row.task_id = None, target.pk
    for part in parts:
        part.pk, part.artifact_id = None, made[part.artifact_id].pk
    batches = []
    for start in range(0, len(events), batch):
        chunk = events[start : start + batch]
        low, high = chunk[0].seq, chunk[-1].seq
        chunk_parts = [p for p in parts if low <= p.seq <= high]
        counts: dict[int, int] = {}
        for part in chunk_parts:
            counts[part.artifact_id] = max(counts.get(part.artifact_id, 0), part.index + 1)
        chunk_messages = [m for m in messages if low <= m.seq <= high]
        batches.append((chunk, chunk_parts, chunk_messages, counts))
    digests = {a.pk: a.digest for a in made.values()}
    t0 = time.perf_counter()
    for chunk, chunk_parts, chunk_messages, counts in batches:
        last = chunk[-1]
        with transaction.atomic():
            relax_commit("stream")  # committed as record() commits a stream's batch
            RemoteTask.objects.filter(pk=target.pk).update(
                **snapshot, last_seq=last.seq, last_hash=last.hash,
                last_event_at=last.received_at, updated_at=last.received_at,
            )  # fmt: skip
            insert_rows(TaskEvent, chunk)
            insert_rows(ArtifactPart, chunk_parts, batch_size=500)
            insert_rows(ConversationMessage, chunk_messages, batch_size=500)
            for artifact_pk, count in counts.items():
                Artifact.objects.filter(pk=artifact_pk).update(
                    part_count=count, digest=digests[artifact_pk], updated_seq=last.seq,
                    updated_at=last.received_at,
                )  # fmt: skip
    return time.perf_counter() - t0


def p3(db: str, quick: bool) -> list[Row]:
    start_worker_loop()
    n = 600 if quick else 10_000
    agent = make_agent("p3")
    # Warm up (first queries, connection, the relay's Redis connection).
    warm = make_task(agent)
    record_stream(warm, mixed_events(warm, 50))
    # Record and floor alternate, best of each: a noisy neighbour on a shared machine
    # hurts both alike, and a pause in one round does not decide the row. Five rounds: on
    # this two-core machine the same code measured 1.25x to 2.0x its floor within minutes.
    rounds = 1 if quick else 5
    recorded = relayed = floor = float("inf")
    count = n  # the fewest relayed in any round
    for _ in range(rounds):
        task = make_task(agent)
        took = record_stream(task, mixed_events(task, n))
        if took[1] < relayed:
            recorded, relayed = took[0], took[1]
        count = min(count, took[2])
        floor = min(floor, rows_floor(task, make_task(agent)))
    rate, floor_rate = n / relayed, n / floor
    ratio = relayed / floor
    # The absolute goal is for PostgreSQL; SQLite keeps the earlier 2,000/s.
    least = 5000 if db == "postgres" else 2000
    ok = rate >= least and ratio <= 1.5 and count == n
    return [
        Row(
            "P3",
            f"events recorded (log + fold) and relayed /s, one fast stream ({n} events)",
            f"{rate:,.0f}/s",
            f">= {least:,}/s, <= 1.5x floor",
            ok,
            floor=f"{floor_rate:,.0f}/s",
            ratio=f"{ratio:.2f}x",
            db=db,
            note=(
                f"record_many() in calls of {BATCH} as a watcher makes them (each given the next call of "
                f"its take of 500 as ahead; half statusUpdate, half appended artifact chunks), "
                f"relay through the worker-style relay coroutine to Redis, clock stopped when the last "
                f"message reached a listener process (standing for the web process) in task-<pk>; "
                f"relayed {count}/{n}; recording alone took "
                f"{recorded:.2f}s ({n / recorded:,.0f}/s); best of {rounds} alternating rounds each. "
                f"Floor: the rows record() wrote (log rows, artifact parts, messages, the artifact and "
                f"snapshot updates), read back and written again for another task by the same bulk "
                f"inserts (insert_rows: COPY on PostgreSQL, bulk_create on SQLite) and plain updates, "
                f"one transaction per batch of {BATCH} ({floor:.3f}s)."
            ),
            extra={
                "n": n,
                "rate": rate,
                "floor_rate": floor_rate,
                "ratio": ratio,
                "relayed": count,
                "record_rate": n / recorded,
            },
        )
    ]


# P8: the hash chain's cost --------------------------------------------------------------------


def p8(db: str, quick: bool) -> list[Row]:
    """Ingest with the hash chain (content digests + chained row hashes) against the same without.

    The "without" runs replace the two hash functions record() calls with
    constants, in this bench process only. On and off alternate (three rounds
    each, best of each) so that a noisy neighbour hurts both alike.
    """
    from unittest import mock

    from tasks_app.services import record as record_module

    start_worker_loop()
    n = 600 if quick else 6000
    agent = make_agent("p8")
    warm = make_task(agent)
    record_stream_only(warm, mixed_events(warm, 100))
    best = {"on": float("inf"), "off": float("inf")}
    for _ in range(3):
        for mode in ("on", "off"):
            task = make_task(agent)
            events = mixed_events(task, n)
            if mode == "on":
                seconds = record_stream_only(task, events)
            else:
                with (
                    mock.patch.object(record_module, "chain_hash", lambda previous, row: ""),
                    mock.patch.object(record_module, "row_text", lambda **form: b""),
                    mock.patch.object(record_module, "content_digest", lambda raw: ("", 0)),
                    mock.patch.object(record_module, "text_digest", lambda text: ("", 0)),
                ):
                    seconds = record_stream_only(task, events)
            best[mode] = min(best[mode], seconds)
    on_rate, off_rate = n / best["on"], n / best["off"]
    cost = 1 - on_rate / off_rate
    return [
        Row(
            "P8",
            f"ingest with the hash chain on, one fast stream ({n} events)",
            f"{on_rate:,.0f}/s",
            "chain costs <= 15% of ingest",
            cost <= 0.15,
            floor=f"{off_rate:,.0f}/s",
            ratio=f"{cost:+.0%}",
            db=db,
            note=(
                f"record_many() in calls of {BATCH} as a watcher makes them (half statusUpdate, half appended chunks), best of "
                f"3 alternating runs each; floor: the same with the content digest and the chained row "
                f"hash replaced by constants. Cost = 1 - on/off = {cost:.1%}."
            ),
            extra={"n": n, "on_rate": on_rate, "off_rate": off_rate, "cost": cost},
        )
    ]


def record_stream_only(task: Any, events: list[dict]) -> float:
    """Seconds to record ``events`` as a watcher does (no relay wait)."""
    t0 = time.perf_counter()
    record_as_a_watcher(task, events)
    return time.perf_counter() - t0


# P4 -------------------------------------------------------------------------------------------


def p4(db: str, quick: bool) -> list[Row]:
    start_worker_loop()
    small, large = (200, 2000) if quick else (2000, 20_000)
    agent = make_agent("p4")
    warm = make_task(agent)
    record_stream(warm, [chunk_event(warm, i) for i in range(100)])
    times = {}
    counts = {}
    for n in (small, large):
        task = make_task(agent)
        _, relayed, count = record_stream(task, [chunk_event(task, i) for i in range(n)])
        times[n], counts[n] = relayed, count
    from tasks_app.models import Artifact

    parts = (
        Artifact.objects.filter(task__agent=agent)
        .order_by("-part_count")
        .values_list("part_count", flat=True)
        .first()
    )
    growth = times[large] / times[small]
    lost = (small - counts[small]) + (large - counts[large])
    ok = growth <= 12 and lost == 0 and parts == large
    return [
        Row(
            "P4",
            f"one artifact of {large:,} chunks vs one of {small:,} (time ratio)",
            f"{growth:.1f}x ({times[large]:.2f}s vs {times[small]:.2f}s)",
            "<= 12x (linear)",
            ok,
            db=db,
            note=(
                f"appended artifactUpdate chunks through record_many() in calls of {BATCH} as a watcher makes them, relay on, "
                f"timed until the last chunk was relayed; the large artifact holds {parts} parts; "
                f"{lost} relay messages missing."
            ),
            extra={
                "small": small,
                "large": large,
                "t_small": times[small],
                "t_large": times[large],
                "growth": growth,
                "lost": lost,
            },
        )
    ]


# P5 -------------------------------------------------------------------------------------------


def _bulk_tasks(agent: Any, n: int) -> None:
    from django.utils import timezone

    from tasks_app.models import INTERRUPTED_STATES, RemoteTask

    states = [
        "TASK_STATE_WORKING",
        "TASK_STATE_COMPLETED",
        "TASK_STATE_FAILED",
        "TASK_STATE_INPUT_REQUIRED",
        "TASK_STATE_COMPLETED",
        "TASK_STATE_CANCELED",
    ]
    now = timezone.now()
    chunk = 5000
    for start in range(0, n, chunk):
        rows = [
            RemoteTask(
                agent=agent,
                remote_id=f"bulk-{i}",
                context_id=f"ctx-{i % 997}",
                title=f"bulk task {i}",
                phase=RemoteTask.Phase.TASK,
                state=states[i % len(states)],
                created_at=now - dt.timedelta(seconds=n - i),
                updated_at=now - dt.timedelta(seconds=n - i),
                # record() stores when a question was asked; these were asked when made.
                asked_at=now - dt.timedelta(seconds=n - i)
                if states[i % len(states)] in INTERRUPTED_STATES
                else None,
                last_seq=1,
            )
            for i in range(start, min(n, start + chunk))
        ]
        with transaction.atomic():
            RemoteTask.objects.bulk_create(rows, batch_size=1000)


def _bulk_events(task: Any, n: int) -> None:
    from django.utils import timezone

    from tasks_app.models import RemoteTask, TaskEvent

    now = timezone.now()
    chunk = 5000
    for start in range(0, n, chunk):
        rows = []
        for i in range(start, min(n, start + chunk)):
            raw = status_event(task, i) if i % 2 == 0 else chunk_event(task, i)
            rows.append(
                TaskEvent(
                    task_id=task.pk,
                    seq=i + 1,
                    received_at=now,
                    channel="stream",
                    kind=next(iter(raw)),
                    raw=raw,
                    state_after="TASK_STATE_WORKING",
                )
            )
        with transaction.atomic():
            TaskEvent.objects.bulk_create(rows, batch_size=1000)
    RemoteTask.objects.filter(pk=task.pk).update(last_seq=n)


def _p95(samples: list[float]) -> float:
    if len(samples) < 2:
        return samples[0] if samples else float("nan")
    return statistics.quantiles(samples, n=20, method="inclusive")[18]


def _time_get(client: Any, url: str, repeat: int) -> tuple[list[float], int, str]:
    """GET ``url`` ``repeat`` times; (seconds each, last status, error)."""
    samples: list[float] = []
    status, error = 0, ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            response = client.get(url)
            if getattr(response, "streaming", False):
                for _chunk in response.streaming_content:
                    pass
            status = response.status_code
        except Exception as exc:
            return samples, 500, f"{type(exc).__name__}: {exc}"[:300]
        samples.append(time.perf_counter() - t0)
    return samples, status, error


def _resolves(path: str) -> bool:
    from django.urls import Resolver404, resolve

    try:
        match = resolve(path)
    except Resolver404:
        return False
    # The overview's catch-all, if any, does not count as the page we want.
    return getattr(match, "url_name", "") not in ("overview",)


def _deep_cursor(position: int) -> str:
    """The list's keyset cursor pointing ``position`` rows down the default order.

    The list paginates by cursor (no page numbers), so a deep page is reached by
    the cursor the view itself would have put in its "next" link.
    """
    from tasks_app.models import RemoteTask

    try:
        from tasks_app import cursors
    except ImportError:
        return ""
    row = RemoteTask.objects.order_by("-updated_at", "-pk").values_list("updated_at", "pk")[
        position : position + 1
    ]
    found = list(row)
    return "?cursor=" + cursors.encode(found[0][0], found[0][1]) if found else ""


EXPORT_CANDIDATES = (
    "/tasks/{pk}/export/?format=json",
    "/tasks/{pk}/export.jsonl",
    "/tasks/{pk}/events.jsonl",
    "/tasks/{pk}/events/export/",
    "/tasks/{pk}/export",
)
# Pages measured when their URL exists (the inbox comes with its own work: it is measured as
# soon as /inbox/ resolves, and named as not measured until then).
HOOK_PAGES = {"inbox": "/inbox/"}


def _bulk_actions(agents: list[Any], users: list[Any], n: int) -> None:
    """``n`` operator actions spread over ``agents`` and ``users``; runs of 10 share a timestamp
    (the audit page's keyset must step over ties)."""
    from django.utils import timezone

    from tasks_app.actionlog import KNOWN_ACTIONS
    from tasks_app.models import OperatorAction

    actions = list(KNOWN_ACTIONS)
    now = timezone.now()
    chunk = 5000
    for start in range(0, n, chunk):
        rows = [
            OperatorAction(
                agent=agents[i % len(agents)], actor=users[(i // 2) % len(users)], action=actions[i % len(actions)],
                payload={"reason": f"bench {i}", "token": "never-shown"}, outcome="requested",
                created_at=now - dt.timedelta(seconds=(n - i) // 10),
            )
            for i in range(start, min(n, start + chunk))
        ]  # fmt: skip
        with transaction.atomic():
            OperatorAction.objects.bulk_create(rows, batch_size=1000)


def _export_orm(task_pk: int) -> Iterator[bytes]:
    """What an export view should do: stream JSON lines from an iterator, never a list."""
    from tasks_app.models import TaskEvent

    rows = (
        TaskEvent.objects.filter(task_id=task_pk)
        .order_by("seq")
        .values_list("seq", "received_at", "channel", "kind", "state_after", "note", "raw")
    )
    for seq, received_at, channel, kind, state, note, raw in rows.iterator(chunk_size=1000):
        yield (
            json.dumps(
                {
                    "seq": seq,
                    "received_at": received_at.isoformat(),
                    "channel": channel,
                    "kind": kind,
                    "state": state,
                    "note": note,
                    "raw": raw,
                }
            )
            + "\n"
        ).encode()


def _measure_stream(produce: Callable[[], Iterator[bytes]]) -> tuple[float, int, int]:
    """(seconds, bytes, tracemalloc peak bytes) of consuming ``produce()``."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    total = 0
    for chunk in produce():
        total += len(chunk)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return seconds, total, peak


def p5(db: str, quick: bool) -> list[Row]:
    from django.contrib.auth import get_user_model
    from django.test import Client

    from tasks_app.runtime import sqlite_stats

    n_tasks, n_history, n_export = (2_000, 500, 20_000) if quick else (100_000, 10_000, 100_000)
    repeat = 5 if quick else 20
    agent = make_agent("p5")
    # The other project's agent: its actions are in the log but not the bench person's to see.
    elsewhere = make_agent("p5-elsewhere")
    t0 = time.perf_counter()
    _bulk_tasks(agent, n_tasks)
    history = make_task(agent, "history")
    _bulk_events(history, n_history)
    export_task = make_task(agent, "export")
    _bulk_events(export_task, n_export)
    small_export = make_task(agent, "export-small")
    _bulk_events(small_export, n_export // 10)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
    seed = time.perf_counter() - t0

    from tasks_app import cursors
    from tasks_app.models import Membership, OperatorAction, Project

    # An auditor of the agent's project: reads every page (the per-user lookup, as people
    # with a role go through it) and may use the audit log and exports.
    user = get_user_model().objects.create_user("bench", password="bench-password-1")
    other = get_user_model().objects.create_user("bench-op", password="bench-password-1")
    elsewhere.project = Project.objects.create(name="p5-elsewhere")
    elsewhere.save(update_fields=["project"])
    Membership.objects.create(user=user, project_id=agent.project_id, role=Membership.Role.AUDITOR)
    t1 = time.perf_counter()
    _bulk_actions([agent, elsewhere], [user, other], n_tasks)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")  # what autovacuum does after a bulk load
    else:
        sqlite_stats.refresh()  # what up and beat do (tasks_app/runtime/sqlite_stats.py)
    seed += time.perf_counter() - t1
    mid = OperatorAction.objects.filter(agent=agent).order_by("-created_at", "-id").values_list("created_at", "pk")[
        n_tasks // 4 : n_tasks // 4 + 1
    ]  # fmt: skip
    deep = "?cursor=" + cursors.encode(*mid[0]) if mid else ""
    client = Client()
    client.force_login(user)
    rows: list[Row] = []

    pages = {
        "task list, first page": "/tasks/",
        "task list, deep page": "/tasks/" + _deep_cursor(n_tasks // 2),
        "task list, state filter": "/tasks/?state=TASK_STATE_WORKING",
        f"task page, {n_history:,} events": f"/tasks/{history.pk}/",
        "task log, first page": f"/tasks/{history.pk}/events/",
        "task log, last page": f"/tasks/{history.pk}/events/?after={n_history - 50}",
        f"audit log, first page ({n_tasks:,} actions)": "/audit/",
        "audit log, deep page": "/audit/" + deep,
        "audit log, person filter": "/audit/?person=bench-op",
        "audit log, action + dates": "/audit/?action=cancel&since=2000-01-01&until=2999-12-31",
        **HOOK_PAGES,
    }
    results: dict[str, Any] = {}
    missing = [url for url in pages.values() if not _resolves(url.split("?")[0])]
    for label, url in pages.items():
        if url.split("?")[0] in missing:
            continue
        client.get(url)  # warm (templates, first queries)
        samples, status, error = _time_get(client, url, repeat)
        results[label] = {
            "p95_ms": _p95(samples) * 1000 if samples else None,
            "status": status,
            "error": error,
        }
    if results:
        worst_label = max(results, key=lambda k: results[k]["p95_ms"] or 1e9)
        worst = results[worst_label]["p95_ms"]
        bad = {k: v for k, v in results.items() if v["status"] != 200}
        detail = "; ".join(
            f"{k}: p95 {v['p95_ms']:.1f} ms" if v["p95_ms"] is not None else f"{k}: {v['error']}"
            for k, v in results.items()
        )
        if bad:
            detail += "; not 200: " + ", ".join(
                f"{k} ({v['status']} {v['error']})" for k, v in bad.items()
            )
        rows.append(
            Row(
                "P5",
                f"page server time p95, worst page ({n_tasks:,} tasks)",
                f"{worst:.1f} ms" if worst is not None else "error",
                "<= 100 ms per page",
                (worst is not None and worst <= 100 and not bad),
                db=db,
                note=f"Django test Client, logged in, {repeat} GETs per page after one warm-up, in-process (no network); "
                f"{detail}. Worst: {worst_label}. Seeding took {seed:.0f}s."
                + (f" Not measured (no such URL yet): {', '.join(missing)}." if missing else ""),
                extra={"pages": results, "missing": missing},
            )
        )
    else:
        rows.append(
            Row(
                "P5",
                "page server time p95",
                "not measured",
                "<= 100 ms per page",
                None,
                db=db,
                note=f"the views do not exist yet: {', '.join(missing)} do not resolve.",
            )
        )

    export_url = next(
        (
            u.format(pk=export_task.pk)
            for u in EXPORT_CANDIDATES
            if _resolves(u.format(pk=export_task.pk).split("?")[0])
        ),
        "",
    )
    if export_url:
        small_url = export_url.replace(f"/{export_task.pk}/", f"/{small_export.pk}/")

        def via_view(url: str) -> Callable[[], Iterator[bytes]]:
            def produce() -> Iterator[bytes]:
                response = client.get(url)
                if getattr(response, "streaming", False):
                    yield from response.streaming_content
                else:
                    yield response.content

            return produce

        big, small = via_view(export_url), via_view(small_url)
        how = f"GET {export_url.replace(str(export_task.pk), '<pk>')} through the test Client"
    else:

        def big() -> Iterator[bytes]:
            return _export_orm(export_task.pk)

        def small() -> Iterator[bytes]:
            return _export_orm(small_export.pk)

        how = (
            "no export view exists yet: measured JSON lines streamed from the ORM with "
            ".values_list(...).iterator(chunk_size=1000), i.e. what such a view must do"
        )
    _, _, s_peak = _measure_stream(small)
    b_sec, b_bytes, b_peak = _measure_stream(big)
    growth = b_peak / s_peak if s_peak else float("inf")
    ok = growth <= 2.0
    rows.append(
        Row(
            "P5",
            f"export of {n_export:,} events: memory high-water vs {n_export // 10:,}",
            f"{b_peak / 1e6:.1f} MB vs {s_peak / 1e6:.1f} MB ({growth:.1f}x)",
            "constant memory (<= 2x for 10x rows)",
            ok,
            db=db,
            note=f"{how}; tracemalloc peak while consuming; {b_bytes / 1e6:.1f} MB written in {b_sec:.1f}s "
            f"({n_export / b_sec:,.0f} events/s under tracemalloc).",
            extra={
                "peak_large": b_peak,
                "peak_small": s_peak,
                "growth": growth,
                "export_view": export_url,
            },
        )
    )
    return rows
