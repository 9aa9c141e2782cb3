"""Exports, streamed in constant memory: a task's history (JSON, JSON Lines) and the action log (CSV).

Every producer here is a generator of ``bytes`` that reads the database in keyset
batches (by ``seq`` for a task's log, by ``(created_at, id)`` for the action log), so
memory stays the size of one batch whatever the size of the log; the views hand them
to ``StreamingHttpResponse`` (through :func:`as_async` under ASGI, where Django would
otherwise read a sync iterator whole first), the commands write them to a file or
stdout. The format is documented in docs/exports.md; each event carries its row hash,
so an export can be verified offline (the chain is described in
``tasks_app.services.chain``).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from tasks_app.a2a import safejson
from tasks_app.actionlog import after_cursor, sanitize
from tasks_app.models import OperatorAction, RemoteTask, TaskEvent
from tasks_app.previews import batch_within
from tasks_app.services.chain import timestamp_text
from tasks_app.services.record import (
    STORED,
    contents_of_entry,
    iter_stored_contents,
    references_in,
)

FORMAT = "a2a-dashboard/task-history"
VERSION = 1
# Rows per database read, and characters of their raw JSON at most (a batch holds one row
# however long). Big part contents are stored by reference, but a row's other JSON (a status
# update's metadata, say) goes up to WATCH_MAX_EVENT_BYTES: 200 rows of 2 MB made an export
# peak at 184 MB. Written out, the lines go as soon as they add up to EXPORT_CHUNK_CHARS.
EVENT_BATCH = 200
EVENT_BATCH_CHARS = 4 * 1024 * 1024
EXPORT_CHUNK_CHARS = 1024 * 1024
ACTION_BATCH = 500
EVENT_FIELDS = (
    "seq",
    "received_at",
    "channel",
    "kind",
    "state_after",
    "note",
    "actor_id",
    "actor__username",
    "raw",
    "digest",
    "hash",
)
CSV_COLUMNS = ("id", "created_at", "person", "action", "project", "agent_id", "agent", "task_id", "task",
               "outcome", "details")  # fmt: skip

_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))
# How a reference's key looks in an event's JSON text (see _noting_references).
STORED_KEY = _ENCODER.encode(STORED)


def _iso(moment: Any) -> str | None:
    return timestamp_text(moment) if moment else None


def task_header(task: RemoteTask) -> dict[str, Any]:
    """What the export says about the task itself (its events follow)."""
    agent = task.agent
    return {
        "id": task.pk,
        "remote_id": task.remote_id,
        "context_id": task.context_id,
        "title": task.title,
        "agent": {"id": agent.pk, "name": agent.name, "base_url": agent.base_url},
        "project": agent.project.name if agent.project_id else None,
        "phase": task.phase,
        "mode": task.mode,
        "state": task.state,
        "started_by": task.started_by.get_username()
        if task.started_by_id and task.started_by
        else None,
        "created_at": _iso(task.created_at),
        "updated_at": _iso(task.updated_at),
        "settled_at": _iso(task.settled_at),
        "last_seq": task.last_seq,
        "last_hash": task.last_hash,
    }


def event_record(row: dict[str, Any]) -> dict[str, Any]:
    """One exported event from a ``.values(*EVENT_FIELDS)`` row."""
    return {
        "seq": row["seq"],
        "received_at": timestamp_text(row["received_at"]),
        "channel": row["channel"],
        "kind": row["kind"],
        "state_after": row["state_after"],
        "note": row["note"],
        "actor": row["actor__username"],
        "actor_id": row["actor_id"],
        "raw": row["raw"],
        "digest": row["digest"],
        "hash": row["hash"],
    }


class ExportIncomplete(Exception):
    """The task went away while its export was written: what was written is not the whole."""


def event_rows(
    task_pk: int, batch: int = EVENT_BATCH, up_to: int | None = None
) -> Iterator[dict[str, Any]]:
    """The task's log in seq order, one keyset batch at a time (never the whole log).

    ``up_to``: the last seq the export's header counts (its ``last_seq``). Rows recorded
    while a long export streams would otherwise follow a header whose ``last_hash`` they
    pass, and the offline check would take the export for a tampered one.
    """
    after = 0
    while True:
        rows_qs = TaskEvent.objects.filter(task_id=task_pk, seq__gt=after)
        if up_to is not None:
            rows_qs = rows_qs.filter(seq__lte=up_to)
        last, more = batch_within(rows_qs, batch, EVENT_BATCH_CHARS)
        read = False
        if last is not None:
            chosen = rows_qs.filter(seq__lte=last).order_by("seq").values(*EVENT_FIELDS)
            for row in chosen:
                yield event_record(row)
                after, read = row["seq"], True  # rows read, not sized: see ExportIncomplete
        if not more or not read:
            break
    if up_to is not None and after < up_to and not RemoteTask.objects.filter(pk=task_pk).exists():
        # Removed (say by retention) while exported: ended here, the export would look whole
        # but stop short of its header's last_seq. A log with a gap is still exported as it
        # is: the offline check says where it breaks.
        raise ExportIncomplete(
            f"task {task_pk} was removed while it was exported (after row {after} of {up_to})"
        )


def _header(task: RemoteTask) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "exported_at": _iso(timezone.now()),
        "task": task_header(task),
    }


def jsonl_chunks(task: RemoteTask, batch: int = EVENT_BATCH) -> Iterator[bytes]:
    """JSON Lines: a first line describing the task, then one line per event, in seq order,
    then one line per content the events refer to (see :func:`referred_contents`)."""
    yield (_ENCODER.encode(_header(task)) + "\n").encode("ascii")
    lines: list[str] = []
    referred: dict[str, int] = {}
    chars = 0
    for event in event_rows(task.pk, batch, up_to=task.last_seq):
        lines.append(_noting_references(_ENCODER.encode(event), event, referred))
        chars += len(lines[-1])
        if len(lines) >= batch or chars >= EXPORT_CHUNK_CHARS:
            yield ("\n".join(lines) + "\n").encode("ascii")
            lines.clear()
            chars = 0
    if lines:
        yield ("\n".join(lines) + "\n").encode("ascii")
    for content in referred_contents(task.pk, referred):
        yield (_ENCODER.encode(content) + "\n").encode("ascii")


def _noting_references(line: str, event: dict[str, Any], referred: dict[str, int]) -> str:
    """``line`` (the event's JSON); the contents its raw refers to are added to ``referred``."""
    if STORED_KEY in line:  # rare: a quick look at the text, then the walk
        referred.update(references_in(event["raw"]))
    return line


def referred_contents(task_pk: int, referred: dict[str, int]) -> Iterator[dict[str, str]]:
    """``{"sha256", "content"}`` for each content in ``referred`` that the task keeps, one at a
    time. The log keeps a big part content once, in its artifact or conversation row, and a
    reference in the entry (``record.by_reference``); an export without them lost the
    content with the task (retention exports, then deletes). ``referred``: ``{sha256:
    chars}``; contents shorter than today's ``INLINE_CONTENT_BYTES`` are looked for too when
    a reference says so (one made before the setting was raised).
    """
    sent: set[str] = set()
    if not referred:
        return
    shortest = max(0, min(referred.values()) - 1)
    for digest, content in iter_stored_contents(
        task_pk, min(shortest, settings.INLINE_CONTENT_BYTES), lengths=set(referred.values())
    ):
        if digest in referred and digest not in sent:
            sent.add(digest)
            yield {"sha256": digest, "content": content}


def entry_contents(event: TaskEvent) -> list[dict[str, str]]:
    """``{"sha256", "content"}`` for each content one entry refers to, as an export carries
    them: found through the entry's own rows first (``record.contents_of_entry``), and only
    a reference found nowhere there through the task's whole scan (:func:`referred_contents`)."""
    referred = references_in(event.raw)
    near = contents_of_entry(event.task_id, event.seq, event.raw, referred)
    missing = {digest: chars for digest, chars in referred.items() if digest not in near}
    if missing:
        near.update((c["sha256"], c["content"]) for c in referred_contents(event.task_id, missing))
    return [{"sha256": digest, "content": near[digest]} for digest in referred if digest in near]


def json_chunks(task: RemoteTask, batch: int = EVENT_BATCH) -> Iterator[bytes]:
    """One JSON document, written as it is read: the header's keys, ``events``, the contents
    they refer to (``contents``), then a count."""
    head = _ENCODER.encode(_header(task))
    yield (head[:-1] + ',"events":[\n').encode("ascii")
    count, last_hash = 0, ""
    lines: list[str] = []
    referred: dict[str, int] = {}
    chars = 0
    for event in event_rows(task.pk, batch, up_to=task.last_seq):
        line = _noting_references(_ENCODER.encode(event), event, referred)
        lines.append(("," if count else "") + line)
        count += 1
        chars += len(line)
        last_hash = event["hash"]
        if len(lines) >= batch or chars >= EXPORT_CHUNK_CHARS:
            yield ("\n".join(lines) + "\n").encode("ascii")
            lines.clear()
            chars = 0
    if lines:
        yield ("\n".join(lines) + "\n").encode("ascii")
    yield b'],"contents":[\n'
    for index, content in enumerate(referred_contents(task.pk, referred)):
        yield (("," if index else "") + _ENCODER.encode(content) + "\n").encode("ascii")
    yield (f'],"event_count":{count},"events_last_hash":{_ENCODER.encode(last_hash)}}}\n').encode(
        "ascii"
    )


def task_chunks(task: RemoteTask, fmt: str) -> Iterator[bytes]:
    return json_chunks(task) if fmt == "json" else jsonl_chunks(task)


# The action log as CSV -----------------------------------------------------------------------


def _cell(value: Any) -> str:
    """A CSV cell that a spreadsheet will not run as a formula (agent names come from outside)."""
    # Cleaned: a lone surrogate in an older row stopped the CSV midway (UTF-8 has none).
    text = "" if value is None else safejson.clean_text(str(value))
    return "'" + text if text[:1] in FORMULA_STARTS else text


# What a spreadsheet may read as the start of a formula: the usual four, the whitespace some
# skip before one, and the fullwidth forms some take for the ASCII ones.
FORMULA_STARTS = frozenset("=+-@\t\r\n\uff1d\uff0b\uff0d\uff20")


def action_rows(
    qs: QuerySet[OperatorAction], batch: int = ACTION_BATCH
) -> Iterator[OperatorAction]:
    """Rows newest first, a keyset batch at a time on (created_at, id)."""
    cursor = None
    base = qs.select_related("actor", "agent__project", "task").only(
        "id", "created_at", "action", "payload", "outcome", "task_id", "agent_id", "actor_id",
        "actor__username", "agent__name", "agent__project__name", "task__title", "task__remote_id",
    )  # fmt: skip
    while True:
        rows = list(after_cursor(base, cursor)[:batch])
        yield from rows
        if len(rows) < batch:
            return
        cursor = (rows[-1].created_at, rows[-1].pk)


def action_csv_row(row: OperatorAction) -> list[str]:
    task = row.task if row.task_id else None
    return [
        _cell(v)
        for v in (
            row.pk,
            timestamp_text(row.created_at),
            row.actor.get_username() if row.actor_id and row.actor else "",
            row.action,
            row.agent.project.name if row.agent_id and row.agent else "",
            row.agent_id or "",
            row.agent.name if row.agent_id and row.agent else "",
            row.task_id or "",
            (task.title or task.remote_id) if task else "",
            row.outcome,
            json.dumps(
                sanitize(row.payload if isinstance(row.payload, dict) else {"value": row.payload}),
                ensure_ascii=False,
                sort_keys=True,
            ),
        )
    ]


def csv_chunks(qs: QuerySet[OperatorAction], batch: int = ACTION_BATCH) -> Iterator[bytes]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CSV_COLUMNS)
    for written, row in enumerate(action_rows(qs, batch), start=1):
        writer.writerow(action_csv_row(row))
        if written % batch == 0:
            yield buffer.getvalue().encode("utf-8")
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue().encode("utf-8")


# Delivery ----------------------------------------------------------------------------------


async def as_async(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """The chunks for an ASGI server, one database batch per thread hop (never read whole)."""
    step = sync_to_async(lambda: next(chunks, None), thread_sensitive=True)
    while (chunk := await step()) is not None:
        yield chunk


def write_atomically(path: Path, chunks: Iterable[bytes], mode: int = 0o600) -> int:
    """Write ``chunks`` to ``path`` through a temporary file in the same folder, then rename.

    A reader (or a crash) never sees half a file: it is either the old file or the whole
    new one. The file is made with ``mode`` from the start (exports hold agent content).
    Returns the bytes written.
    """
    path = Path(path)
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    except OSError as exc:
        # mkstemp's error names its random temporary file; the folder is what to fix.
        raise type(exc)(exc.errno, exc.strerror, str(path.parent)) from exc
    written = 0
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                written += len(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return written
