"""``record()``: the one path by which anything learned about a task enters the mirror.

Every channel (send response, stream, resubscribe, poll, push, operator, system)
calls :func:`record` or :func:`record_many`. Each call:

1. parses every incoming object into an *entry* (its kind, payload and raw JSON);
   anything malformed becomes a ``protocol-error`` entry instead of an exception;
2. in one transaction, reads the task's snapshot, folds the entries into it,
   appends one log row per entry that says something new (``seq`` handed out by
   compare-and-set on ``RemoteTask.last_seq``: a concurrent writer makes the
   update match no row, and the whole fold is retried on fresh data), and writes
   the snapshot, artifact parts and conversation rows;
3. after commit, relays the appended rows to browsers (``tasks_app.relay``).

Entries equal to what the mirror already holds (a push and a poll carrying the
same status, a snapshot equal to the view, a message already stored) append
nothing: recording is idempotent.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import random
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, models, transaction
from django.db.models import Max, Q
from django.db.models.base import ModelState
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Length
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from tasks_app import metrics, relay
from tasks_app.a2a import normalize, safejson
from tasks_app.a2a.states import STATE_SUBMITTED, transition_problem
from tasks_app.models import (
    INTERRUPTED_STATES,
    TERMINAL_STATES,
    Artifact,
    ArtifactPart,
    ConversationMessage,
    JSONText,
    RemoteTask,
    ReplacedContent,
    TaskEvent,
)
from tasks_app.services import sent_ahead, surfaces, waits
from tasks_app.services.chain import (
    canonical_json,
    chain_hash,
    content_digest,
    row_text,
    sorted_compact_encoder,
    text_digest,
    timestamp_text,
)
from tasks_app.services.snapshot import event_json

log = logging.getLogger(__name__)

A2A_KINDS = ("task", "message", "statusUpdate", "artifactUpdate")
LOCAL_KINDS = ("operator", "system", "gap", "protocolError")
KNOWN_STATES = {
    "TASK_STATE_SUBMITTED",
    "TASK_STATE_WORKING",
    *INTERRUPTED_STATES,
    *TERMINAL_STATES,
}
MAX_RETRIES = 100
# Channels written only by the task's lease holder (fenced): one ordered connection each.
HOLDER_CHANNELS = ("stream", "resubscribe", "send-response")
# The note of an entry logged, not applied, because the mirror holds a newer status.
OLDER_STATUS = "older than the status already held; snapshot unchanged"


class RecordError(Exception):
    """The mirror could not take the entries (the task row vanished, or contention persisted)."""


@dataclass
class Entry:
    kind: str
    payload: Any
    raw: Any
    note: str = ""
    # sha256 of the canonical raw content (see tasks_app/services/chain.py).
    digest: str = ""
    # Bytes of agent content the entry stores (its canonical raw size).
    size: int = 0
    # The canonical JSON of ``raw`` when it was written for the digest (see insert_rows).
    text: bytes | None = None
    # An artifact update's parts, each as its canonical text (``_encode_part``): written
    # when parsed, which may be ahead (``Batch``), as they need nothing the fold knows.
    part_texts: list[str] | None = None


@dataclass
class Recorded:
    """What one call appended: its seqs (empty when everything was already known)."""

    seqs: list[int] = field(default_factory=list)
    state: str = ""
    notes: list[str] = field(default_factory=list)
    # True when the writer's lease had moved on: nothing was written (see ``fence``).
    fenced: bool = False
    # The kind of each appended row (a turn that appended only protocol errors made no progress).
    kinds: list[str] = field(default_factory=list)
    # True when the task's byte budget refused content in this call (BUDGET_TASK_BYTES).
    over_budget: bool = False
    # Refusals not logged again, as (kind, note): the log holds the same delivery refused
    # (``_Fold._refused_again``). A watcher still counts a turn of them as fruitless.
    repeated: list[tuple[str, str]] = field(default_factory=list)
    # Whether a row applied something the agent said (see ``progress``).
    news: bool = False

    @property
    def progress(self) -> bool:
        """Whether anything the agent said was new (protocol errors, gaps and notes are not,
        nor an entry logged and not applied: a snapshot older than the status or the
        artifacts held). Counted as progress, a GetTask lagging the stream was read again
        every second, a row each time, and never parked."""
        return self.news

    @property
    def duplicate(self) -> bool:
        return not self.seqs


# 1. Parsing ---------------------------------------------------------------------------------


def parse_entry(obj: Any) -> Entry:
    """Turn a StreamResponse-shaped object (or one of our own kinds) into an entry.

    ``obj`` is ``{"task": {...}}``, ``{"statusUpdate": {...}}``, …, or
    ``{"operator": {...}}`` / ``{"system": {...}}`` / ``{"gap": {...}}`` for
    entries we write ourselves. Objects with a ``raw`` attribute (the protocol
    layer's stream events) are unwrapped.
    """
    obj = getattr(obj, "raw", obj)
    # The canonical text is needed for the digest; when it shows nothing to clean (the
    # usual case), the value is taken as it is and its text hashed once.
    text = _canonical_or_none(obj)
    if text is None or safejson.may_need_cleaning(text):
        obj, replaced = safejson.clean(obj)
        text = None
    else:
        replaced = 0
    entry = _parse(obj)
    if text is not None and entry.raw is obj:
        entry.digest, entry.size = text_digest(text)
        entry.text = text
    else:
        try:
            entry.digest, entry.size = content_digest(entry.raw)
        except (RecursionError, ValueError, TypeError) as exc:
            return _unwritable(exc)
    if replaced:
        # One count for both kinds (safejson.clean): the words name each change it makes.
        note = (
            f"{replaced} value(s) no database can store changed: lone surrogates and NUL "
            "replaced by U+FFFD, surrogate halves joined, NaN and Infinity written as strings"
        )
        entry.note = f"{entry.note}; {note}" if entry.note else note
    return entry


def _unwritable(exc: Exception) -> Entry:
    """An object no JSON encoder writes, even cleaned: nested past the recursion limit, an
    integer past Python's 4,300 digits, a value that is not JSON. Agents' JSON cannot be any
    of these (``safejson.loads`` refuses them); an object built in-process can, and it is one
    protocol-error row, not an exception out of ``record()``."""
    message = f"an entry no JSON encoder can write ({type(exc).__name__}): not kept"
    entry = _parse({"protocolError": {"message": message}})
    entry.digest, entry.size = content_digest(entry.raw)
    return entry


def _canonical_or_none(obj: Any) -> bytes | None:
    """The canonical JSON of ``obj``, or None when it is not JSON as it is (clean() decides)."""
    try:
        return canonical_json(obj)
    except (TypeError, ValueError, RecursionError):
        return None


def _parse(obj: Any) -> Entry:
    if not isinstance(obj, dict):
        return Entry(
            "protocol-error",
            None,
            _jsonable(obj),
            f"expected a JSON object, got {type(obj).__name__}",
        )
    # A member that is null is not set (ProtoJSON), as the stream parser reads it too.
    keys = [key for key in obj if (key in A2A_KINDS or key in LOCAL_KINDS) and obj[key] is not None]
    if len(keys) != 1:
        return Entry(
            "protocol-error",
            None,
            obj,
            "expected exactly one of task, message, statusUpdate, artifactUpdate; "
            f"got keys {sorted(obj)[:8]}",
        )
    kind = keys[0]
    payload = obj[kind]
    if kind == "protocolError":
        message = payload.get("message", "") if isinstance(payload, dict) else str(payload)
        return Entry("protocol-error", payload, obj, str(message)[:2000])
    if not isinstance(payload, dict):
        return Entry("protocol-error", None, obj, f"{kind} is not a JSON object")
    problem = _check(kind, payload)
    if problem:
        return Entry("protocol-error", None, obj, f"{kind}: {problem}")
    entry = Entry(kind, _normalized(kind, payload), obj)
    if kind == "artifactUpdate":
        parts = entry.payload["artifact"].get("parts") or []
        entry.part_texts = [_encode_part(part) for part in parts]
    elif kind == "statusUpdate":
        _timestamp(entry.payload["status"])  # parsed now, kept for the fold (cached)
    return entry


# A system entry's note (the log row's line under its kind) holds this much of its detail.
SYSTEM_NOTE_CHARS = 300


def _system_note(payload: dict) -> str:
    """Our own entry's event and detail as its row's note: the row said only "system", and
    "answer-failed: ... the task is gone" was in its raw JSON alone."""
    event, detail = payload.get("event"), payload.get("detail")
    if not isinstance(event, str) or not event:
        return ""
    note = f"{event}: {detail}" if isinstance(detail, str) and detail else event
    return note if len(note) <= SYSTEM_NOTE_CHARS else note[: SYSTEM_NOTE_CHARS - 1] + "…"


def _normalized(kind: str, payload: dict) -> dict:
    """The payload without default-valued optional fields (the log keeps it as it came)."""
    if kind == "task":
        return normalize.task(payload)
    if kind == "statusUpdate":
        return {**payload, "status": normalize.status(payload["status"])}
    if kind == "artifactUpdate":
        return {**payload, "artifact": normalize.artifact(payload["artifact"])}
    if kind == "message":
        return normalize.message(payload)
    return payload


TYPED_VALUES_NOTE = (
    "a message we sent, carried back by the agent, kept as the conversation holds it "
    "(values typed into password fields hidden)"
)

# Message ids looked up in one query at most (see _Fold._lookup_messages).
LOOKUP_SLICE = 5_000

# Ids are stored in columns of this many characters (RemoteTask, Artifact, ConversationMessage).
MAX_ID_CHARS = 300


def id_problem(value: Any, name: str, *, required: bool = True) -> str:
    """Why ``value`` cannot be the id ``name`` (empty: it can). Absent is fine unless required.

    The fold keys dicts and sets by ids and stores them in columns: an id that is a
    list would raise in the fold, a longer one in the database, for every later
    entry of the task. Said here, it is one protocol-error row.
    """
    if value is None or value == "":
        return f"missing {name}" if required else ""
    if not isinstance(value, str):
        return f"{name} is not a string"
    if len(value) > MAX_ID_CHARS:
        return f"{name} is longer than {MAX_ID_CHARS} characters"
    return ""


def _check(kind: str, payload: dict) -> str:
    """What makes an A2A payload unusable (empty: nothing); its shape, not its story."""
    if kind == "task":
        return (
            id_problem(payload.get("id"), "id")
            or id_problem(payload.get("contextId"), "contextId", required=False)
            or _check_status(payload.get("status"))
            or _check_list(payload, "artifacts", _check_artifact)
            or _check_list(payload, "history", _check_message)
            or _rows_problem(payload.get("artifacts"), payload.get("history"))
        )
    if kind == "statusUpdate":
        return (
            id_problem(payload.get("taskId"), "taskId")
            or id_problem(payload.get("contextId"), "contextId", required=False)
            or _check_status(payload.get("status"))
        )
    if kind == "artifactUpdate":
        problem = id_problem(payload.get("taskId"), "taskId") or id_problem(
            payload.get("contextId"), "contextId", required=False
        )
        artifact = payload.get("artifact")
        if problem or not isinstance(artifact, dict):
            return problem or "missing artifact.artifactId"
        return _check_artifact(artifact, "artifact.") or _rows_problem([artifact], None)
    if kind == "message":
        return _check_message(payload)
    return ""


def _rows_problem(artifacts: Any, history: Any) -> str:
    """Whether an entry asks for more rows than one entry may make (``WATCH_MAX_EVENT_ROWS``
    parts and messages, ``WATCH_MAX_EVENT_ARTIFACTS`` artifacts): a million empty parts are
    3 MB of JSON, well within an event's bytes, and took 22 s and 760 MB to write."""
    artifacts = [a for a in artifacts if isinstance(a, dict)] if isinstance(artifacts, list) else []
    if len(artifacts) > settings.WATCH_MAX_EVENT_ARTIFACTS:
        return (
            f"{len(artifacts):,} artifacts; at most {settings.WATCH_MAX_EVENT_ARTIFACTS:,} "
            "an entry (WATCH_MAX_EVENT_ARTIFACTS)"
        )
    parts = sum(len(a["parts"]) for a in artifacts if isinstance(a.get("parts"), list))
    messages = len(history) if isinstance(history, list) else 0
    if parts + messages > settings.WATCH_MAX_EVENT_ROWS:
        return (
            f"{parts:,} artifact parts and {messages:,} history messages; at most "
            f"{settings.WATCH_MAX_EVENT_ROWS:,} an entry (WATCH_MAX_EVENT_ROWS)"
        )
    return ""


def _check_list(payload: dict, key: str, check: Callable[..., str]) -> str:
    """Each item of ``payload[key]`` (a list, or absent) that is an object passes ``check``.

    Items that are not objects, or name no id, are skipped by the fold (a snapshot is not
    refused for them); an id of the wrong type or length refuses it.
    """
    items = payload.get(key)
    if items is None:
        return ""
    if not isinstance(items, list):
        return f"{key} is not a list"
    for index, item in enumerate(items):
        problem = check(item, f"{key}[{index}].", required=False) if isinstance(item, dict) else ""
        if problem:
            return problem
    return ""


def _check_artifact(artifact: dict, where: str = "", *, required: bool = True) -> str:
    problem = id_problem(artifact.get("artifactId"), f"{where}artifactId", required=required)
    if problem:
        return problem
    parts = artifact.get("parts", [])
    if not isinstance(parts, list):
        return f"{where}parts is not a list"
    # Each part is a row of its own, stored as JSON: a null one was SQL NULL, refused by the
    # database, and the whole batch (a push drain's, a stream's) failed with it.
    for index, part in enumerate(parts):
        if not isinstance(part, dict):
            return f"{where}parts[{index}] is not an object"
    return ""


def _check_message(message: dict, where: str = "", *, required: bool = True) -> str:
    problem = id_problem(
        message.get("messageId"), f"{where}messageId", required=required
    ) or id_problem(message.get("contextId"), f"{where}contextId", required=False)
    if problem:
        return problem
    if not isinstance(message.get("parts", []), list):
        return f"{where}parts is not a list"
    return ""


def _check_status(status: Any) -> str:
    if not isinstance(status, dict):
        return "missing status"
    state = status.get("state")
    if not isinstance(state, str) or state not in KNOWN_STATES:
        return f"unknown state {state!r}"[:300]
    message = status.get("message")
    if message is None:
        return ""
    if not isinstance(message, dict):
        return "status.message is not an object"
    # A status message without an id is shown, never stored as a message.
    return _check_message(message, "status.message.", required=False)


def _same_message(one: Any, other: Any) -> bool:
    """Whether two status messages (or None) are the same message: the same id, or the same
    content under another id (an agent that makes up a message id each time it writes its
    status, each GetTask, would ask a new question at every poll)."""
    if one is None or other is None:
        return one is other
    if one.get("messageId") and one.get("messageId") == other.get("messageId"):
        return True
    return _without_id(one) == _without_id(other)


def _without_id(message: dict) -> dict:
    return {key: value for key, value in message.items() if key != "messageId"}


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)[:2000]


def _messages_in(entry: Entry) -> list[dict]:
    """The messages (with ids) an entry carries: its own, a status message, a history."""
    payload = entry.payload if isinstance(entry.payload, dict) else {}
    found: list[Any] = []
    if entry.kind in ("message",):
        found.append(payload)
    elif entry.kind == "operator":
        found.append(payload.get("message"))
    elif entry.kind in ("task", "statusUpdate"):
        found.append((payload.get("status") or {}).get("message"))
        found.extend(payload.get("history") or [])
    return [m for m in found if isinstance(m, dict) and m.get("messageId")]


# Digests ------------------------------------------------------------------------------------


# What ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` writes.
_encode_part = sorted_compact_encoder(ensure_ascii=False)


def _canonical(value: Any) -> bytes:
    return _encode_part(value).encode()


def chain_digest(digest: str, parts: Sequence[Any]) -> str:
    """Extend the chained digest of an artifact's parts by ``parts``."""
    return chain_texts(digest, [_encode_part(part) for part in parts])


def chain_texts(digest: str, texts: Sequence[str]) -> str:
    """:func:`chain_digest` of parts given as their canonical texts (a part row is written
    from its text: ``PART_TEXT``)."""
    for text in texts:
        digest = hashlib.sha256(digest.encode() + text.encode()).hexdigest()
    return digest


# An artifact's labels: (name, description, metadata, extensions), as an artifact row keeps
# them; a new artifact starts from none.
Labels = tuple[str, str, Any, Any]
NO_LABELS: Labels = ("", "", {}, [])


def labels_of(artifact: Artifact) -> Labels:
    return (artifact.name, artifact.description, artifact.metadata, artifact.extensions)


def labels_after(current: Labels, data: dict) -> Labels:
    """The labels an artifact has once ``data`` (a chunk's or a snapshot's artifact) is applied:
    a name or description given replaces the held one, metadata and extensions likewise."""
    name, description, metadata, extensions = current
    return (
        str(data.get("name") or name)[:500],
        str(data.get("description") or description),
        data["metadata"] if isinstance(data.get("metadata"), dict) else metadata,
        data["extensions"] if isinstance(data.get("extensions"), list) else extensions,
    )


def _timestamp(status: dict) -> datetime | None:
    value = status.get("timestamp")
    return _parse_timestamp(value) if isinstance(value, str) else None


# How far ahead of our clock an agent's status timestamp may be and still order statuses.
# Held, one stamped in the year 9999 made every later status "older": the task never took
# the agent's end, a cancel or a refresh again.
CLOCK_AHEAD = timedelta(minutes=10)
AHEAD_NOTE = (
    f"timestamp more than {CLOCK_AHEAD.seconds // 60} minutes ahead of our clock: "
    "ordered as an unstamped status"
)


@functools.lru_cache(maxsize=256)
def _parse_timestamp(value: str) -> datetime | None:
    """A status timestamp as an aware datetime; cached, as a fold asks for one status's up to three times."""
    try:
        parsed = parse_datetime(value)
        if parsed is None:
            return None
        if timezone.is_naive(parsed):
            parsed = timezone.make_aware(parsed, timezone.UTC)
        # Stored in UTC: a moment that has none (year 1 at +01:00) is no timestamp.
        parsed.astimezone(UTC)
    except (ValueError, OverflowError):
        return None
    return parsed


# Big contents, stored once ------------------------------------------------------------------

STORED = "$stored"  # the key of a part whose content is kept in its part or conversation row
# What the note of a row that keeps references says (the event page looks for it).
STORED_ONCE = "content stored once"


def by_reference(raw: Any) -> tuple[Any, int]:
    """``raw`` with each big part content (over INLINE_CONTENT_BYTES) replaced by a reference.

    The part row keeps the content; the log row keeps ``{"$stored": {"field",
    "sha256", "chars"}}`` in place of the part's ``text`` or ``raw``, so a 30 MB
    artifact is stored once, not twice. ``replay`` puts the content back from
    the part rows (``with_content``). Returns the new raw (shared parts are
    copied, never changed in place) and how many characters moved.
    """
    if not isinstance(raw, dict):
        return raw, 0
    update = raw.get("artifactUpdate")
    if isinstance(update, dict) and isinstance(update.get("artifact"), dict):
        artifact, moved = parts_by_reference(update["artifact"])
        return (
            ({**raw, "artifactUpdate": {**update, "artifact": artifact}}, moved)
            if moved
            else (raw, 0)
        )
    task = raw.get("task")
    if isinstance(task, dict) and isinstance(task.get("artifacts"), list):
        artifacts, total = [], 0
        for artifact in task["artifacts"]:
            artifact, moved = parts_by_reference(artifact)
            artifacts.append(artifact)
            total += moved
        return ({**raw, "task": {**task, "artifacts": artifacts}}, total) if total else (raw, 0)
    return raw, 0


def parts_by_reference(value: Any, kept: Collection[str] | None = None) -> tuple[Any, int]:
    """An artifact (or a message: anything with ``parts``) with each big part content replaced
    by a reference (see :func:`by_reference`), and how many characters moved.

    ``kept``: only contents whose sha256 is in it move (those another row is known to hold).
    """
    if not isinstance(value, dict) or not isinstance(value.get("parts"), list):
        return value, 0
    limit = settings.INLINE_CONTENT_BYTES
    parts, moved = [], 0
    for part in value["parts"]:
        movable = _movable(part, limit, kept)
        if movable is not None:
            name, content, digest = movable
            reference = {"field": name, "sha256": digest, "chars": len(content)}
            part = {**{k: v for k, v in part.items() if k != name}, STORED: reference}
            moved += len(content)
        parts.append(part)
    return ({**value, "parts": parts}, moved) if moved else (value, 0)


def _movable(part: Any, limit: int, kept: Collection[str] | None) -> tuple[str, str, str] | None:
    """The content of ``part`` a reference replaces, as (field, content, sha256): its first
    ``text`` or ``raw`` over ``limit`` (and in ``kept``, when given); None: none.

    One a part, and none in a part that has a ``$stored`` key already (an agent's own):
    a second reference overwrote the first, and that content was lost.
    """
    if not isinstance(part, dict) or STORED in part:
        return None
    for name in ("text", "raw"):
        content = part.get(name)
        if isinstance(content, str) and len(content) > limit:
            digest = _sha256(content)
            if kept is None or digest in kept:
                return name, content, digest
    return None


def messages_by_reference(raw: Any, kept: Collection[str]) -> tuple[Any, int]:
    """``raw`` with the big part contents of the messages it carries replaced by references,
    where ``kept`` (sha256s) says the conversation holds that very content; and how many
    characters moved.

    A message with an id is stored as a conversation row when it is first seen, whole: a
    file an operator attached, or one an agent sent in a status message, was kept there
    and again in the log row, and in every later row that repeated the message. Those rows
    now keep the reference (``kept``: the big contents of the conversation's copies of the
    messages a row carries, see ``_Fold._conversation_copies``), and ``with_content`` puts
    the content back from the conversation.
    """
    return _map_messages(raw, lambda message: parts_by_reference(message, kept))


def big_contents(messages: Sequence[Any], limit: int) -> set[str]:
    """The sha256 of each part content over ``limit`` characters in ``messages``."""
    return {
        _sha256(content)
        for message in messages
        for content in contents_over(parts_of(message), limit)
    }


def parts_of(value: Any) -> Any:
    """A message's or an artifact's ``parts`` (anything else: None)."""
    return value.get("parts") if isinstance(value, dict) else None


def contents_over(parts: Any, limit: int) -> Iterator[str]:
    """Each content (``text`` or ``raw``) over ``limit`` characters of the parts in ``parts``
    (a list; anything else has none)."""
    for part in parts if isinstance(parts, list) else ():
        for name in ("text", "raw"):
            content = part.get(name) if isinstance(part, dict) else None
            if isinstance(content, str) and len(content) > limit:
                yield content


def _map_messages(raw: Any, change: Callable[[Any], tuple[Any, int]]) -> tuple[Any, int]:
    """``raw`` with ``change`` applied to each message it carries (where ``_messages_in``
    finds them: a message entry, an operator's message, a status message, a snapshot's
    history), copied where a message changed (shared values are never changed in place),
    and the sum of what ``change`` counted."""
    if not isinstance(raw, dict):
        return raw, 0
    for kind in ("message", "operator"):
        body = raw.get(kind)
        if not isinstance(body, dict):
            continue
        if kind == "message":
            message, moved = change(body)
            return ({**raw, kind: message}, moved) if moved else (raw, 0)
        if isinstance(body.get("message"), dict):
            message, moved = change(body["message"])
            return ({**raw, kind: {**body, "message": message}}, moved) if moved else (raw, 0)
        return raw, 0
    for kind in ("statusUpdate", "task"):
        body = raw.get(kind)
        if not isinstance(body, dict):
            continue
        changed, total = body, 0
        status = body.get("status")
        if isinstance(status, dict) and isinstance(status.get("message"), dict):
            message, moved = change(status["message"])
            if moved:
                changed, total = {**changed, "status": {**status, "message": message}}, moved
        if kind == "task" and isinstance(body.get("history"), list):
            history, moved_in_history = [], 0
            for item in body["history"]:
                item, moved = change(item) if isinstance(item, dict) else (item, 0)
                history.append(item)
                moved_in_history += moved
            if moved_in_history:
                changed, total = {**changed, "history": history}, total + moved_in_history
        return ({**raw, kind: changed}, total) if total else (raw, 0)
    return raw, 0


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def with_content(raw: Any, contents: dict[str, str]) -> Any:
    """The reverse of :func:`by_reference` and :func:`messages_by_reference`, from
    ``{sha256: content}``; unknown ones stay references."""

    def restored(value: Any) -> tuple[Any, int]:
        if not isinstance(value, dict) or not isinstance(value.get("parts"), list):
            return value, 0
        parts, count = [], 0
        for part in value["parts"]:
            if _ours(part, contents):
                reference = part[STORED]
                part = {k: v for k, v in part.items() if k != STORED}
                part[reference["field"]] = contents[reference["sha256"]]
                count += 1
            parts.append(part)
        return ({**value, "parts": parts}, count) if count else (value, 0)

    def restore(artifact: Any) -> Any:
        return restored(artifact)[0]

    raw, _ = _map_messages(raw, restored)
    if isinstance(raw, dict) and isinstance(raw.get("artifactUpdate"), dict):
        update = raw["artifactUpdate"]
        return {**raw, "artifactUpdate": {**update, "artifact": restore(update.get("artifact"))}}
    if (
        isinstance(raw, dict)
        and isinstance(raw.get("task"), dict)
        and isinstance(raw["task"].get("artifacts"), list)
    ):
        return {
            **raw,
            "task": {**raw["task"], "artifacts": [restore(a) for a in raw["task"]["artifacts"]]},
        }
    return raw


def as_it_came(raw: Any, digest: str, contents: dict[str, str]) -> Any:
    """A log row's entry with the contents its references point to put back
    (:func:`with_content`), when that gives the entry as it came: the one whose digest the
    row keeps (references are made after the digest, from the entry as parsed).

    An agent may send a ``$stored`` key shaped exactly like one of ours, naming a content
    the task keeps (its sha256 is no secret): by its shape ``_ours`` takes it for a
    reference. Put back, it is content the agent never sent, and a replay folding it did
    not meet the view the agent's entry made. Such an entry is given back as stored (with
    one of ours beside it, that one stays a reference too).
    """
    if not references_in(raw):
        return raw
    restored = with_content(raw, contents)
    if not digest:  # a row without one (none is written so): as before
        return restored
    try:
        same = content_digest(restored)[0] == digest
    except (RecursionError, ValueError, TypeError):
        same = False
    return restored if same else raw


def _ours(part: Any, contents: dict[str, str]) -> bool:
    """Whether ``part`` holds a reference as ``parts_by_reference`` writes one, to a content in
    ``contents``: the field it names (``text`` or ``raw``) absent, and the content as long as
    it says. An agent may send a ``$stored`` key of its own: one naming a field that is
    there, or no such field (a list made ``with_content`` raise), or another length, is
    content the agent sent, and stays as it came."""
    reference = part.get(STORED) if isinstance(part, dict) else None
    if not isinstance(reference, dict):
        return False
    field, digest = reference.get("field"), reference.get("sha256")
    return (
        field in ("text", "raw")
        and field not in part
        and isinstance(digest, str)
        and digest in contents
        and reference.get("chars") == len(contents[digest])
    )


def stored_contents(task_pk: int, longer_than: int | None = None) -> dict[str, str]:
    """``{sha256: content}`` of the task's big part contents (what references point to),
    in its part rows and conversation rows, and kept from replaced ones (``longer_than``: see
    :func:`iter_stored_contents`)."""
    found: dict[str, str] = {}
    for digest, content in iter_stored_contents(task_pk, longer_than):
        found.setdefault(digest, content)
    return found


# Lengths a scan asks the database to choose by, at most (an export's can be thousands, past
# what SQLite takes as parameters of one statement); past it, only the hashing is chosen.
LENGTHS_IN_SQL = 500


def iter_stored_contents(
    task_pk: int, longer_than: int | None = None, lengths: Collection[int] | None = None
) -> Iterator[tuple[str, str]]:
    """``(sha256, content)`` of each part content over ``longer_than`` characters (by default
    ``INLINE_CONTENT_BYTES``) the task keeps, one row at a time (an export streams them; the
    same content may come more than once).

    A reference made under a lower ``INLINE_CONTENT_BYTES`` than today's is found by passing
    less than its ``chars`` (see :func:`references_in`). ``lengths``: only contents of these
    many characters (a reference says its content's length, and only such a content can be
    the one it names): the part rows are chosen by the database, and no other content is
    hashed. A reference an agent made up would otherwise hash every content the task keeps.
    """
    limit = settings.INLINE_CONTENT_BYTES if longer_than is None else longer_than
    wanted = None if lengths is None else set(lengths)
    parts = (
        ArtifactPart.objects.filter(artifact__task_id=task_pk)
        .annotate(size=Length(Cast("part", models.TextField())))
        .filter(size__gt=limit)  # its JSON text is at least as long as any content in it
    )
    if wanted is not None and len(wanted) <= LENGTHS_IN_SQL:
        parts = parts.annotate(
            text_len=Length(KT("part__text")), raw_len=Length(KT("part__raw"))
        ).filter(Q(text_len__in=wanted) | Q(raw_len__in=wanted))
    for part in parts.values_list("part", flat=True).iterator():
        for content in contents_over([part], limit):
            if wanted is None or len(content) in wanted:
                yield _sha256(content), content
    # Messages' contents, which the conversation keeps (see messages_by_reference).
    messages = (
        ConversationMessage.objects.filter(task_id=task_pk)
        .annotate(size=Length(Cast("message", models.TextField())))
        .filter(size__gt=limit)  # its JSON text is at least as long as any content in it
        .values_list("message", flat=True)
    )
    for message in messages.iterator():
        for content in contents_over(parts_of(message), limit):
            if wanted is None or len(content) in wanted:
                yield _sha256(content), content
    # Contents whose part rows an artifact's replacement deleted (see _Fold._keep_replaced).
    replaced = ReplacedContent.objects.filter(task_id=task_pk)
    if wanted is not None and len(wanted) <= LENGTHS_IN_SQL:
        replaced = replaced.annotate(chars=Length("content")).filter(chars__in=wanted)
    replaced = replaced.values_list("sha256", "content")
    yield from replaced.iterator()


def contents_of_entry(task_pk: int, seq: int, raw: Any, referred: dict[str, int]) -> dict[str, str]:
    """``{sha256: content}`` of the contents ``referred`` that the rows around one entry keep:
    the part rows the entry wrote (its ``seq``, of the artifacts it names), the conversation
    rows of the messages it carries, and the contents kept from replaced parts.

    An entry's JSON asks this first: the task's whole scan (:func:`iter_stored_contents`)
    read every big content the task keeps, up to its byte budget, for each entry shown.
    A reference found nowhere here (a part another row wrote) is left to that scan.
    """
    wanted = set(referred)
    lengths = set(referred.values())  # only a content of a reference's length can be its
    found: dict[str, str] = {}
    if not wanted:
        return found

    def keep(parts: Any) -> None:
        for content in contents_over(parts, 0):
            if len(content) not in lengths:
                continue
            digest = _sha256(content)
            if digest in wanted:
                found.setdefault(digest, content)

    kept = ReplacedContent.objects.filter(task_id=task_pk, sha256__in=wanted)
    found.update(kept.values_list("sha256", "content"))
    messages, artifacts = _ids_with_parts(raw)
    if messages and wanted - found.keys():
        for message in ConversationMessage.objects.filter(
            task_id=task_pk, message_id__in=messages
        ).values_list("message", flat=True):
            keep(parts_of(message))
    if artifacts and wanted - found.keys():
        for part in ArtifactPart.objects.filter(
            artifact__task_id=task_pk, artifact__artifact_id__in=artifacts, seq=seq
        ).values_list("part", flat=True):
            keep([part])
    return found


def _ids_with_parts(raw: Any) -> tuple[list[str], list[str]]:
    """The message ids and artifact ids of the values with ``parts`` anywhere in ``raw``."""
    messages: set[str] = set()
    artifacts: set[str] = set()
    stack = [raw]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("parts"), list):
                if isinstance(item.get("messageId"), str):
                    messages.add(item["messageId"])
                if isinstance(item.get("artifactId"), str):
                    artifacts.add(item["artifactId"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return sorted(messages), sorted(artifacts)


def references_in(value: Any) -> dict[str, int]:
    """``{sha256: chars}`` of each reference (``{"$stored": {...}}``) anywhere in ``value``."""
    found: dict[str, int] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            reference = item.get(STORED)
            if isinstance(reference, dict) and isinstance(reference.get("sha256"), str):
                chars = reference.get("chars")
                found[reference["sha256"]] = chars if type(chars) is int else 0
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


# 2. Folding ---------------------------------------------------------------------------------


@dataclass
class _Row:
    """An entry that will be appended, with what it does to the mirror."""

    entry: Entry
    kind: str
    note: str = ""
    apply: bool = True
    state_after: str = ""
    # The row sets a new status in input-required/auth-required: a new question.
    asks: bool = False
    # An artifact update: the digest its parts were chained onto, and the digest after them
    # (the fold computes it; writing the parts reuses it when it starts from the same digest).
    chained: tuple[str, str] | None = None
    # Each of its parts' canonical text, written by the fold's chain (see ``PART_TEXT``).
    part_texts: list[str] | None = None


class _Rows(list):
    """The rows a fold appends; each is stamped with the task's state right after it.

    It reads the state from the fold's task and changes, not through the fold: a fold
    holding its rows that held the fold was a reference cycle, so each call's entries and
    part rows (a streamed 1 MB chunk, twice) waited for the cyclic collector, which a
    worker runs rarely (``eventloop.tune_gc``): a worker's memory grew by the size of a
    90 MB artifact while it streamed.
    """

    def __init__(self, task: RemoteTask, changes: dict[str, Any]) -> None:
        super().__init__()
        self.task = task
        self.changes = changes
        # The digests of the entries appended (a refusal repeated in one batch, see
        # ``_Fold._refused_again``).
        self.digests: set[str] = set()

    def append(self, row: _Row) -> None:
        row.state_after = self.changes.get("state", self.task.state)
        self.digests.add(row.entry.digest)
        super().append(row)


class _Fold:
    """Folds entries into an in-memory copy of the snapshot, then writes it."""

    def __init__(
        self,
        task: RemoteTask,
        channel: str,
        *,
        gap_check: bool,
        fence: str | None,
        artifacts: dict[str, Artifact] | None = None,
        whole: bool = False,
        at: datetime | None = None,
    ) -> None:
        self.task = task
        self.initial_state = task.state
        self.channel = channel
        self.gap_check = gap_check
        self.fence = fence
        self.over_budget = False
        # Columns the fold's changes assume, checked by the compare-and-set (beside last_seq):
        # a change of watch bookkeeping must not overwrite another writer's (see _unpark).
        self.expect: dict[str, Any] = {}
        self.repeated: list[tuple[str, str]] = []
        # Read once per fold (settings are looked up on each access).
        self.budget = settings.BUDGET_TASK_BYTES
        # A status stamped later than this is not ordered by its stamp (CLOCK_AHEAD).
        self.latest = (at or timezone.now()) + CLOCK_AHEAD
        self.artifact_cap = settings.BUDGET_TASK_ARTIFACTS
        self.inline_limit = settings.INLINE_CONTENT_BYTES
        self._digests: set[str] = set()
        # Artifact digests as the entries folded so far leave them (None: removed), so
        # that a batch folds exactly as the same entries recorded one by one.
        self._pending: dict[str, str | None] = {}
        # And their parts, for a snapshot's comparison (``_parts_head``): the first n part rows
        # stored, then these.
        self._pending_parts: dict[str, tuple[int, list]] = {}
        # Which kind of entry last set an artifact's content in this fold ("task" or
        # "artifactUpdate"); for the others, the kind of the row at its ``updated_seq``.
        self._set_by: dict[str, str] = {}
        # Artifact labels as the entries folded so far leave them (``labels``).
        self._labels: dict[str, Labels] = {}
        self._holders: dict[str, int | None] = {}
        self.changes: dict[str, Any] = {}
        self.rows: _Rows = _Rows(task, self.changes)
        # The task's artifacts read so far, by id: all of them when ``_whole``, else those the
        # batch names (``read_task``); ``_absent``: ids looked up and not held. A chunk reads
        # only its own artifact: reading all of them for every batch made one chunk cost
        # 264 ms on a task holding 10,000 (SQLite).
        self._artifacts: dict[str, Artifact] = artifacts or {}
        self._whole = whole
        self._absent: set[str] = set()
        # How many artifacts the task holds after the entries folded so far (None: not
        # counted yet), against BUDGET_TASK_ARTIFACTS.
        self._held_count: int | None = None
        self._message_ids: set[str] | None = None
        self._checked_ids: set[str] = set()
        # Of those, ours stored with password-field values hidden (``without_typed_values``).
        self._hiding_ids: set[str] = set()
        # Messages this fold stored, by id; conversation rows read for their big contents
        # (None: none such), by id (see ``_counted_size`` and ``_conversation_copies``).
        self._remembered: dict[str, dict] = {}
        self._copies: dict[str, dict | None] = {}

    # -- reads, cached for the fold
    def artifacts(self) -> dict[str, Artifact]:
        """Every artifact of the task (a snapshot compares them all; bounded by the cap)."""
        if not self._whole:
            # Unordered: the models' default ordering by a relation costs more to compile than
            # the query takes to run, and a dict needs no order. Instances read before are
            # kept: the write may have changed them already.
            for artifact in Artifact.objects.filter(task_id=self.task.pk).order_by():
                self._artifacts.setdefault(artifact.artifact_id, artifact)
            self._whole = True
        return self._artifacts

    def artifact(self, artifact_id: str) -> Artifact | None:
        """One artifact as the write has left it so far (None: not held)."""
        found = self._artifacts.get(artifact_id)
        if found is not None or self._whole or artifact_id in self._absent:
            return found
        found = Artifact.objects.filter(task_id=self.task.pk, artifact_id=artifact_id).first()
        if found is None:
            self._absent.add(artifact_id)
        else:
            self._artifacts[artifact_id] = found
        return found

    def not_held(self, named: set[str]) -> None:
        """Of the ids read with the task (``read_task``), those it does not hold."""
        self._absent.update(aid for aid in named if aid not in self._artifacts)

    def held_digest(self, artifact_id: str) -> str | None:
        """One artifact's digest after the entries folded so far (None: not held)."""
        if artifact_id in self._pending:
            return self._pending[artifact_id]
        artifact = self.artifact(artifact_id)
        return artifact.digest if artifact is not None else None

    def labels(self, artifact_id: str) -> Labels:
        """An artifact's labels after the entries folded so far (a removed one has none)."""
        if artifact_id in self._labels:
            return self._labels[artifact_id]
        if artifact_id in self._pending and self._pending[artifact_id] is None:
            return NO_LABELS
        stored = self.artifact(artifact_id)
        return labels_of(stored) if stored is not None else NO_LABELS

    def held_count(self) -> int:
        """How many artifacts the task holds after the entries folded so far."""
        if self._held_count is None:
            if self._whole:
                stored = len(self._artifacts)
            else:
                stored = Artifact.objects.filter(task_id=self.task.pk).count()
            # Made or removed by the entries folded so far (a snapshot sets the count itself).
            made = sum(
                1
                for aid, digest in self._pending.items()
                if digest is not None and self.artifact(aid) is None
            )
            self._held_count = stored + made
        return self._held_count

    def _too_many_artifacts(self, entry: Entry, count: int) -> bool:
        """Past BUDGET_TASK_ARTIFACTS: the entry is logged as a protocol error, not applied."""
        if count <= self.artifact_cap:
            return False
        note = (
            f"{count:,} artifacts; a task may hold at most {self.artifact_cap:,} "
            "(BUDGET_TASK_ARTIFACTS): not applied"
        )
        self.rows.append(_Row(entry, "protocol-error", note, apply=False))
        return True

    def held_digests(self) -> dict[str, str]:
        """Each artifact's digest after the entries folded so far (stored, then pending)."""
        held: dict[str, str | None] = {aid: a.digest for aid, a in self.artifacts().items()}
        held.update(self._pending)
        return {aid: digest for aid, digest in held.items() if digest is not None}

    def prefetch_messages(self, entries: list[Entry]) -> None:
        """Look up, in one query, which of the messages the entries carry are stored already."""
        ids = {m["messageId"] for entry in entries for m in _messages_in(entry)}
        self._lookup_messages(ids)

    def _lookup_messages(self, ids: set[str]) -> None:
        if self._message_ids is None:
            self._message_ids = set()
        ids -= self._checked_ids
        # In slices: a database takes only so many values in one query (SQLite refused a
        # history of 260,000 ids, and its error was taken for the database being down).
        listed = sorted(ids)
        for start in range(0, len(listed), LOOKUP_SLICE):
            stored = ConversationMessage.objects.filter(
                task_id=self.task.pk, message_id__in=listed[start : start + LOOKUP_SLICE]
            ).order_by()
            for message_id, hidden in stored.values_list("message_id", "typed_values_hidden"):
                self._message_ids.add(message_id)
                if hidden:
                    self._hiding_ids.add(message_id)
        self._checked_ids |= ids

    def without_typed_values(self, entries: list[Entry]) -> list[Entry]:
        """``entries`` with each of our messages that the conversation keeps with password-field
        values hidden carried as kept there, not as the agent repeats it.

        The person's answer is logged with those values hidden, and the agent gets them. An
        agent's snapshot carries the message back in its history (on every GetTask, in a
        send's reply, in a push), so every reader of the log read them in that row. The
        entry is parsed again from the changed content: its digest, size and the refusal of
        a redelivery are those of what is stored, and a row's note says so.
        """
        if not self._hiding_ids:  # the batch carries none (prefetch_messages looked)
            return entries
        carried = {
            m["messageId"] for entry in entries if entry.kind in A2A_KINDS
            for m in _messages_in(entry)
        } & self._hiding_ids  # fmt: skip
        if not carried:
            return entries
        kept = dict(
            ConversationMessage.objects.filter(task_id=self.task.pk, message_id__in=carried)
            .order_by()
            .values_list("message_id", "message")
        )

        def as_kept(message: Any) -> tuple[Any, int]:
            copy = kept.get(message.get("messageId"))
            return (copy, 1) if copy is not None and copy != message else (message, 0)

        out = []
        for entry in entries:
            raw, changed = (
                _map_messages(entry.raw, as_kept) if entry.kind in A2A_KINDS else (entry.raw, 0)
            )
            if changed:
                entry = parse_entry(raw)
                entry.note = (
                    f"{entry.note}; {TYPED_VALUES_NOTE}" if entry.note else TYPED_VALUES_NOTE
                )
            out.append(entry)
        return out

    def unknown_messages(self, messages: list[dict]) -> list[dict]:
        """The messages (by messageId) that neither the mirror nor this fold holds yet."""
        self._lookup_messages({m["messageId"] for m in messages})
        assert self._message_ids is not None
        fresh, seen = [], set()
        for message in messages:
            mid = message["messageId"]
            if mid not in self._message_ids and mid not in seen:
                seen.add(mid)
                fresh.append(message)
        return fresh

    def remember_messages(self, messages: list[dict]) -> None:
        if self._message_ids is None:
            self._message_ids = set()
        self._message_ids.update(m["messageId"] for m in messages)
        self._remembered.update((m["messageId"], m) for m in messages)

    def _counted_size(self, entry: Entry) -> int:
        """The bytes ``entry`` adds to what the task stores: its size, less each big message
        content the conversation held before it (its log row keeps a reference there, see
        ``_conversation_copies``).

        An agent's snapshots repeat the operator's first message in their history: counted
        whole each time, a 10 MB file passed the task's 64 MB budget after a few polls, while
        it was stored once.
        """
        if entry.size <= self.inline_limit:  # no content of it is over the limit
            return entry.size
        known = self._message_ids or set()
        carried = [m for m in _messages_in(entry) if m["messageId"] in known]
        if not carried:
            return entry.size
        held = {m["messageId"] for m in carried}
        copies = {aid: self._remembered[aid] for aid in held if aid in self._remembered}
        copies.update(self._stored_copies(held - copies.keys()))
        kept = big_contents(list(copies.values()), self.inline_limit)
        saved = 0
        for message in carried:  # what messages_by_reference will move
            parts = parts_of(message)
            for part in parts if isinstance(parts, list) else ():
                movable = _movable(part, self.inline_limit, kept)
                if movable is not None:
                    saved += len(canonical_json(movable[1]))
        return max(0, entry.size - saved)

    def get(self, name: str) -> Any:
        changes = self.changes  # asked about nine times an entry: no getattr when changed
        return changes[name] if name in changes else getattr(self.task, name)

    def set(self, **values: Any) -> None:
        self.changes.update(values)

    # -- the fold of one entry
    def add(self, entry: Entry) -> None:
        counted = entry.kind not in ("operator", "system", "gap")
        used, rows = self.get("stored_bytes"), len(self.rows)
        if counted and not self._within_budget(entry):
            self._end_over_budget(entry)
            return
        handler = getattr(self, "_fold_" + entry.kind.replace("-", "_"), None)
        if handler is None:
            self.rows.append(_Row(entry, entry.kind, entry.note))
            return
        in_batch = entry.digest in self.rows.digests
        handler(entry)
        if counted and len(self.rows) > rows and self._refused_again(entry, rows, in_batch):
            self.repeated.extend((row.kind, row.note) for row in self.rows[rows:])
            del self.rows[rows:]
        if counted and len(self.rows) == rows:
            # Nothing stored (the mirror held it already): nothing counted, so a duplicate
            # costs the same in a batch as recorded on its own (where nothing is written).
            self.set(stored_bytes=used)

    def _end_over_budget(self, entry: Entry) -> None:
        """Past the budget an entry's content is dropped, but not the end it brings.

        A task over its budget took no state change again: cancelled at the agent by an
        operator, or ended there, it went on saying "working" for ever, and never settled.
        An entry that ends the task (a status update or a snapshot with a terminal state,
        the task not ended yet) is kept as a status update of its state and timestamp
        alone, noted so; the rest of it is not stored. A task ends once, so this is one
        small row at most.
        """
        if entry.kind == "statusUpdate":
            task_id, context_id = entry.payload["taskId"], entry.payload.get("contextId")
        elif entry.kind == "task":
            task_id, context_id = entry.payload["id"], entry.payload.get("contextId")
        else:
            return
        status = entry.payload["status"]
        if status["state"] not in TERMINAL_STATES or self.get("state") in TERMINAL_STATES:
            return
        kept = {"state": status["state"]}
        if isinstance(status.get("timestamp"), str):
            kept["timestamp"] = status["timestamp"]
        update = {"taskId": task_id, "status": kept}
        if context_id:
            update["contextId"] = context_id
        ending = parse_entry({"statusUpdate": update})
        ending.note = (
            f"over the task's budget: of this {entry.kind} ({entry.size} bytes) only the "
            "state it ends in is kept"
        )
        self._fold_statusUpdate(ending)

    def _refused_again(self, entry: Entry, first: int, in_batch: bool) -> bool:
        """Whether the rows from ``first`` refuse ``entry`` and the log holds it already
        (or an earlier row of this batch does: ``in_batch``).

        Off the holder's channels a delivery equal to one in the log is the same delivery
        again (as ``_seen_chunk`` says of chunks): a push retried, or a GetTask that reads
        the same snapshot on every poll. A refusal (an illegal transition, a status after
        the end, a snapshot older than the one held) was logged once; logging it on every
        redelivery let a misbehaving agent, or our own polling, write a row each time.
        """
        if self.channel in HOLDER_CHANNELS or not entry.digest:
            return False
        if any(row.apply or row.entry is not entry for row in self.rows[first:]):
            return False
        return in_batch or (
            TaskEvent.objects.filter(task_id=self.task.pk, digest=entry.digest).exists()
        )

    def _within_budget(self, entry: Entry) -> bool:
        """Count the agent's bytes; past the task's budget, one entry says so and the rest is dropped."""
        budget = self.budget
        used = self.get("stored_bytes")
        size = self._counted_size(entry)
        if used + size <= budget:
            self.set(stored_bytes=used + size)
            return True
        self.over_budget = True
        if used <= budget:  # the first entry past the budget: say so, once
            self.set(stored_bytes=budget + 1)
            notice = {"system": {"event": "budget-exceeded", "detail": (
                f"the agent's content for this task passed the {budget}-byte budget "
                f"(BUDGET_TASK_BYTES); a {entry.kind} entry of {entry.size} bytes and anything "
                "after it is not stored"
            ), "digest": entry.digest, "bytes": entry.size}}  # fmt: skip
            self.rows.append(
                _Row(Entry("system", notice["system"], notice), "system", "over budget")
            )
        return False

    # -- the end of a task
    @property
    def settled(self) -> bool:
        return self.get("settled_at") is not None

    def _after_end(self, entry: Entry, what: str) -> None:
        """An entry that would change an ended task: logged with the agent's content, not applied."""
        self.rows.append(
            _Row(
                entry,
                "protocol-error",
                f"changed after the end: {what}; the task is final",
                apply=False,
            )
        )

    def _wrong_task(self, entry: Entry, task_id: str) -> bool:
        remote_id = self.get("remote_id")
        if remote_id and task_id != remote_id:
            self.rows.append(
                _Row(
                    entry,
                    "protocol-error",
                    f"event for task {task_id!r}, expected {remote_id!r}",
                    apply=False,
                )
            )
            return True
        if not remote_id:
            holder = self._mirrored_as(task_id)
            if holder is not None:
                # Another row already mirrors that task (an import listed it first, say):
                # adopting the id here would break the one-row-per-remote-task rule.
                self.rows.append(
                    _Row(
                        entry,
                        "protocol-error",
                        f"task {task_id!r} {MIRRORED_ELSEWHERE}{holder}",
                        apply=False,
                    )
                )
                return True
        return False

    def _mirrored_as(self, task_id: str) -> int | None:
        if task_id not in self._holders:
            self._holders[task_id] = mirrored_elsewhere(self.task.agent_id, task_id, self.task.pk)
        return self._holders[task_id]

    def _adopt(self, task_id: str, context_id: str | None) -> None:
        if not self.get("remote_id"):
            self.set(remote_id=task_id, phase=RemoteTask.Phase.TASK)
            self._request_taken()
        if context_id and not self.get("context_id"):
            self.set(context_id=context_id)

    def _request_taken(self) -> None:
        """The agent took the first message (it named the task, or answered with a message).

        The request is kept to send the same message again (``retry_send``, only while the
        agent is known not to have it) and for its ids (the lookup by contextId); a file
        attached to it was kept a third time there, beside the operator's log entry and the
        conversation, for as long as the task. From here on, each part content over
        ``INLINE_CONTENT_BYTES`` is the log's reference (``parts_by_reference``).
        """
        request = self.get("request")
        if isinstance(request, dict):
            message, moved = parts_by_reference(request.get("message"))
            if moved:
                self.set(request={**request, "message": message})

    def _state_problem(self, new_state: str) -> str:
        return transition_problem(self.get("state") or None, new_state) or ""

    def _from_before_the_end(self, entry: Entry, status: dict) -> bool:
        """Whether an entry the end refuses is only late: a status from before the end the
        mirror holds, stamped earlier, or the reply to our own send (the state when the agent
        took the message), which a fast push task's notifications can overtake. Then it is
        logged as older, not blamed on the agent as a protocol error (the error budget parks
        an agent's tasks)."""
        if self.get("state") not in TERMINAL_STATES or status["state"] in TERMINAL_STATES:
            return False
        if transition_problem(None, status["state"]):  # no state, or one A2A does not have
            return False
        ts, held = self._stamp(status)[0], self._held_stamp()
        older = ts is not None and held is not None and ts < held
        if not (older or self.channel == "send-response"):
            return False
        self._log_as_older(entry)
        return True

    def _submitted_late(self, entry: Entry, status: dict) -> bool:
        """Whether the entry is the reply to our send saying SUBMITTED while the mirror holds
        a later state: the agent's push notifications overtook it. SUBMITTED is only a task's
        first state, so the reply is late; applied, it moved a working task, or one waiting
        for an answer, back to submitted (a soak run: 7 of 40 push tasks)."""
        held = self.get("state")
        if self.channel != "send-response" or status["state"] != STATE_SUBMITTED:
            return False
        if not held or held == STATE_SUBMITTED:
            return False
        self._log_as_older(entry)
        return True

    def _log_as_older(self, entry: Entry) -> None:
        """Logged, not applied: the entry is older than the status the mirror holds."""
        self.rows.append(_Row(entry, entry.kind, OLDER_STATUS, apply=False))

    def _fold_task(self, entry: Entry) -> None:
        task = entry.payload
        if self._wrong_task(entry, task["id"]):
            return
        status = task["status"]
        problem = self._state_problem(status["state"])
        if problem:
            if not self._from_before_the_end(entry, status):
                self.rows.append(_Row(entry, "protocol-error", problem, apply=False))
            return
        if self._submitted_late(entry, status):
            return
        artifacts = [
            a for a in task.get("artifacts") or [] if isinstance(a, dict) and a.get("artifactId")
        ]
        history = [
            m for m in task.get("history") or [] if isinstance(m, dict) and m.get("messageId")
        ]
        wanted = {a["artifactId"]: chain_digest("", a.get("parts") or []) for a in artifacts}
        held = self.held_digests()
        ts, ahead = self._stamp(status)
        status_same = self._status_same(status, ts)
        artifacts_same = wanted == held
        status_message = status.get("message")
        candidates = history + (
            [status_message]
            if isinstance(status_message, dict) and status_message.get("messageId")
            else []
        )
        new_messages = self.unknown_messages(candidates)
        # Metadata the agent changed alone (progress it keeps there, say) is news too; a
        # snapshot without any leaves the held metadata as it is (as applying it does).
        metadata = task.get("metadata")
        metadata_same = not isinstance(metadata, dict) or metadata == (self.get("metadata") or {})
        # So is an artifact renamed (or its metadata changed) with the same parts.
        labels = {a["artifactId"]: labels_after(self.labels(a["artifactId"]), a) for a in artifacts}
        labels_same = all(self.labels(aid) == after for aid, after in labels.items())
        if (
            status_same
            and artifacts_same
            and labels_same
            and metadata_same
            and not new_messages
            and self.get("remote_id")
        ):
            return  # a snapshot equal to the view: nothing new
        if self.settled:
            self._after_end(entry, "a snapshot that differs from the settled task")
            return
        if self._older_than_held(entry, ts):
            # Taken before the status held (a ListTasks page read while a stream went on):
            # applied, it rolled the task back and wrote a false gap entry.
            return
        if (
            status_same
            and not artifacts_same
            and not new_messages
            and self.get("remote_id")
            and self._behind_the_artifacts(artifacts, wanted)
        ):
            # Read before the stream's last chunks of the same status (a ListTasks page, a
            # GetTask): applied, it dropped them, wrote a false gap entry, and the next
            # streamed append landed on the shortened artifact.
            note = "older than the artifacts already held; snapshot unchanged"
            self.rows.append(_Row(entry, "task", note, apply=False))
            return
        if not artifacts_same and self._too_many_artifacts(entry, len(wanted)):
            return
        # A mirror that never held a status (a task just imported) takes its first snapshot
        # as where it begins: nothing was missed, and a "gap" said a stream had broken.
        if (
            self.gap_check
            and self.get("remote_id")
            and self.get("state")
            and not (status_same and artifacts_same)
        ):
            missed = []
            if not status_same and status["state"] == self.get("state"):
                missed.append(f"a status of {status['state']}")
            elif not status_same:
                missed.append(f"state {self.get('state')} -> {status['state']}")
            if not artifacts_same:
                missed.append("artifacts changed")
            gap = Entry("gap", None, {"gap": {"missed": missed}})
            # Only a resubscribe follows a stream that broke; a poll, a refresh or a look at a
            # waiting question reads what happened while no stream was live (an operator's
            # refresh beside an open stream said the stream broke, which it had not).
            why = (
                "the stream broke; events in between were not replayed: "
                if self.channel == "resubscribe"
                else "not seen live; the events in between are not known: "
            )
            self.rows.append(_Row(gap, "gap", why + ", ".join(missed)))
        self._adopt(task["id"], task.get("contextId"))
        self._set_status(status, ts)
        if isinstance(task.get("metadata"), dict):
            self.set(metadata=task["metadata"])
        if not artifacts_same:
            self._pending.update(dict.fromkeys(held))
            self._pending.update(wanted)
            self._held_count = len(wanted)
            self._pending_parts = {a["artifactId"]: (0, a.get("parts") or []) for a in artifacts}
            # Rewritten by this snapshot (its row's seq becomes their updated_seq), or as before.
            self._set_by = {
                aid: "task" if wanted[aid] != held.get(aid) else self._set_by[aid]
                for aid in wanted
                if wanted[aid] != held.get(aid) or aid in self._set_by
            }
        if not (artifacts_same and labels_same):
            for aid in held:
                if aid not in wanted:
                    self._labels.pop(aid, None)  # removed: ``labels`` says none
            self._labels.update(labels)
        asks = not status_same and status["state"] in INTERRUPTED_STATES
        row = _Row(entry, "task", ahead, asks=asks)
        row.artifacts = artifacts  # type: ignore[attr-defined]
        row.replace_artifacts = not (artifacts_same and labels_same)  # type: ignore[attr-defined]
        row.messages = new_messages  # type: ignore[attr-defined]
        self.remember_messages(new_messages)
        self.rows.append(row)

    def _behind_the_artifacts(self, artifacts: list[dict], wanted: dict[str, str]) -> bool:
        """Whether a snapshot's artifacts are each one held or the beginning of one held.

        Such a snapshot shows nothing the mirror lacks: it was read before chunks the
        mirror has. Artifacts held and not in it may be newer than it; an artifact it has
        and the mirror does not, or one that differs otherwise, makes it news.
        """
        held = self.held_digests()
        for data in artifacts:
            aid = data["artifactId"]
            if aid not in held:
                return False
            if wanted[aid] == held[aid]:
                continue
            head = self._parts_head(aid, len(data.get("parts") or []))
            if head is None or chain_digest("", head) != wanted[aid]:
                return False
        return True

    def _parts_head(self, artifact_id: str, count: int) -> list | None:
        """The first ``count`` parts of a held artifact after the entries folded so far
        (None: it has no more than that)."""
        stored = self.artifact(artifact_id)
        stored_count, after = self._pending_parts.get(
            artifact_id, (stored.part_count if stored is not None else 0, [])
        )
        if count >= stored_count + len(after):
            return None
        head: list = []
        if stored is not None and stored_count and count:
            head = list(
                ArtifactPart.objects.filter(
                    artifact_id=stored.pk, index__lt=min(count, stored_count)
                )
                .order_by("index")
                .values_list("part", flat=True)
            )
        return head + after[: count - len(head)]

    def _stamp(self, status: dict) -> tuple[datetime | None, str]:
        """The status's timestamp for ordering (``_timestamp``), and a note when it is too far
        ahead of our clock to be one (``CLOCK_AHEAD``): then the status is unstamped."""
        ts = _timestamp(status)
        if ts is not None and ts > self.latest:
            return None, AHEAD_NOTE
        return ts, ""

    def _held_stamp(self) -> datetime | None:
        """The held status's timestamp for ordering: none when it is ahead of our clock (held
        from before ``CLOCK_AHEAD`` was kept, or the clock was turned back since)."""
        held = self.get("status_timestamp")
        return None if held is not None and held > self.latest else held

    def _status_same(self, status: dict, ts: datetime | None) -> bool:
        """Whether ``status`` (its timestamp ``ts``, see ``_stamp``) is the one held.

        Stamped as the held one, it is the same unless it carries a message the task has not
        had: an agent re-asking within the same second (or reusing one stamp for its steps)
        was dropped silently, and the question it asked again could not be answered. One
        without a message is the same (a GetTask may leave the message out), and so is one
        whose message the conversation holds already (an agent that sends its statuses of
        that second again at every subscribe would be news each time, and never backed off).
        """
        if status["state"] != self.get("state"):
            return False
        message, held_message = status.get("message") or None, self.get("status_message") or None
        current_ts = self._held_stamp()
        if ts is not None and current_ts is not None:
            return ts == current_ts and (
                message is None
                or _same_message(message, held_message)
                or self._known_message(message)
            )
        # Unstamped: the same message, exactly (the rule the log was written by: audit replay
        # folds stored logs with today's rules, so a rule that would append less breaks it).
        return message == held_message

    def _known_message(self, message: dict) -> bool:
        """Whether the conversation (or this fold) holds ``message`` already, by its id."""
        mid = message.get("messageId")
        return isinstance(mid, str) and bool(mid) and not self.unknown_messages([message])

    def _set_status(self, status: dict, ts: datetime | None) -> None:
        self.set(
            state=status["state"],
            status_message=status.get("message") or None,
            status_timestamp=ts or self.get("status_timestamp"),
        )

    def _older_than_held(self, entry: Entry, ts: datetime | None) -> bool:
        """Whether the entry's status is older than the one held: then it is logged, not
        applied (a status update or a snapshot alike)."""
        current_ts = self._held_stamp()
        if ts is None or current_ts is None or ts >= current_ts:
            return False
        self._log_as_older(entry)
        return True

    def _fold_statusUpdate(self, entry: Entry) -> None:
        update = entry.payload
        if self._wrong_task(entry, update["taskId"]):
            return
        status = update["status"]
        ts, ahead = self._stamp(status)
        same = bool(self.get("remote_id")) and self._status_same(status, ts)
        if same and not self._metadata_news(update.get("metadata")):
            return
        state = self.get("state")
        if state in TERMINAL_STATES and status["state"] == state:
            self._after_end(entry, "a status update of the ended task")
            return
        problem = self._state_problem(status["state"])
        if problem:
            if not self._from_before_the_end(entry, status):
                self.rows.append(_Row(entry, "protocol-error", problem, apply=False))
            return
        if self._older_than_held(entry, ts):
            return
        self._adopt(update["taskId"], update.get("contextId"))
        if not same:  # else its status is the one held (its message, maybe left out, too)
            self._set_status(status, ts)
        if isinstance(update.get("metadata"), dict) and update["metadata"]:
            # The agent merges a status update's metadata into the task's (as GetTask shows).
            self.set(metadata={**(self.get("metadata") or {}), **update["metadata"]})
        # The same status with metadata it changes (progress an agent keeps there) is news,
        # as it is in a snapshot; it asks nothing new.
        asks = not same and status["state"] in INTERRUPTED_STATES
        row = _Row(entry, "statusUpdate", ahead, asks=asks)
        message = status.get("message")
        fresh = (
            self.unknown_messages([message])
            if isinstance(message, dict) and message.get("messageId")
            else []
        )
        row.messages = fresh  # type: ignore[attr-defined]
        self.remember_messages(fresh)
        self.rows.append(row)

    def _metadata_news(self, metadata: Any) -> bool:
        """Whether a status update's metadata changes the task's (merged into it)."""
        if not isinstance(metadata, dict) or not metadata:
            return False
        held = self.get("metadata") or {}
        return any(key not in held or held[key] != value for key, value in metadata.items())

    def _fold_artifactUpdate(self, entry: Entry) -> None:
        update = entry.payload
        if self._wrong_task(entry, update["taskId"]):
            return
        if self.channel not in HOLDER_CHANNELS and (
            self._seen_chunk(entry.digest) or self._shown_by_snapshot(update)
        ):
            return  # the same chunk, already taken from another channel (see _seen_chunk)
        # Logged either way (taken, or refused after the end): in the log, as one by one.
        self._digests.add(entry.digest)
        if self.get("state") in TERMINAL_STATES:
            self._after_end(entry, "an artifact update after the task ended")
            return
        data = update["artifact"]
        current = self.held_digest(data["artifactId"])
        if current is None:  # a new artifact
            if self._too_many_artifacts(entry, self.held_count() + 1):
                return
            self._held_count = self.held_count() + 1
        self._adopt(update["taskId"], update.get("contextId"))
        append = bool(update.get("append")) and current is not None
        start = current if append else ""
        parts = data.get("parts") or []
        texts = entry.part_texts  # parsing wrote them (an entry made otherwise: here)
        if texts is None:
            texts = [_encode_part(part) for part in parts]
        self._pending[data["artifactId"]] = digest = chain_texts(start, texts)
        if append:
            held = self.artifact(data["artifactId"])
            stored_count, after = self._pending_parts.get(
                data["artifactId"], (held.part_count if held is not None else 0, [])
            )
            self._pending_parts[data["artifactId"]] = (stored_count, [*after, *parts])
        else:
            self._pending_parts[data["artifactId"]] = (0, list(parts))
        self._set_by[data["artifactId"]] = "artifactUpdate"
        self._labels[data["artifactId"]] = labels_after(
            self.labels(data["artifactId"]) if current is not None else NO_LABELS, data
        )
        self.rows.append(_Row(entry, "artifactUpdate", chained=(start, digest), part_texts=texts))

    def _shown_by_snapshot(self, update: dict) -> bool:
        """Whether an appended chunk is the end of an artifact that a snapshot set last.

        The push drain records a GetTask on ``poll``; a notification the agent sent before
        that GetTask was served, delivered after it, carries a chunk the snapshot showed
        already, and was appended a second time. Off the holder's channels a chunk equal to
        one the log holds is the same chunk (``_seen_chunk``); so is this one.
        """
        data = update["artifact"]
        aid, parts = data["artifactId"], data.get("parts") or []
        if not update.get("append") or not parts or self.held_digest(aid) is None:
            return False
        if aid in self._set_by:
            if self._set_by[aid] != "task":
                return False
            _, after = self._pending_parts[aid]
            tail = after[-len(parts) :] if len(after) >= len(parts) else None
        else:
            stored = self.artifact(aid)
            if stored is None or stored.part_count < len(parts):
                return False
            if not TaskEvent.objects.filter(
                task_id=self.task.pk, seq=stored.updated_seq, kind="task"
            ).exists():
                return False
            tail = list(
                ArtifactPart.objects.filter(
                    artifact_id=stored.pk, index__gte=stored.part_count - len(parts)
                )
                .order_by("index")
                .values_list("part", flat=True)
            )
        return tail is not None and chain_digest("", tail) == chain_digest("", parts)

    def _seen_chunk(self, digest: str) -> bool:
        """Whether an identical artifact update is already in the log.

        A holder's channels (``HOLDER_CHANNELS``) are fenced by its lease and
        each is one ordered connection, so every chunk they deliver is taken,
        even one equal to an earlier chunk. Any other channel (push, poll, an import) may repeat what the stream or an
        earlier delivery already brought: there, a chunk equal to one in the log
        (same canonical content) is the same chunk and is not stored again.
        """
        if digest in self._digests:
            return True
        return TaskEvent.objects.filter(task_id=self.task.pk, digest=digest).exists()

    def _fold_message(self, entry: Entry) -> None:
        message = entry.payload
        if not self.unknown_messages([message]):
            return
        if self.get("state") in TERMINAL_STATES:
            self._after_end(entry, "a message after the task ended")
            return
        if not self.get("remote_id") and self.get("phase") == RemoteTask.Phase.SENDING:
            # A plain Message answered the send: the exchange ends without a task.
            self.set(phase=RemoteTask.Phase.MESSAGE)
            self._request_taken()
            if message.get("contextId"):
                self.set(context_id=message["contextId"])
        self.remember_messages([message])
        row = _Row(entry, "message")
        row.messages = [message]  # type: ignore[attr-defined]
        self.rows.append(row)

    def _fold_system(self, entry: Entry) -> None:
        """Our own notes; ``settled`` marks a terminal task final (see :func:`settle`)."""
        payload = entry.payload if isinstance(entry.payload, dict) else {}
        if payload.get("event") == "send-failed" and not self.get("remote_id"):
            self.set(phase=RemoteTask.Phase.FAILED)
            self._unpark("the send failed; nothing is left to watch")
        if payload.get("event") == "context-refused" and not self.get("remote_id"):
            # The context chosen here is not the task's: the agent's is adopted when it
            # names the task (services.tasks.send_without_context).
            self.set(context_id="")
        if payload.get("event") != "settled":
            self.rows.append(_Row(entry, "system", entry.note or _system_note(payload)))
            return
        if self.settled:
            return
        if self.get("state") not in TERMINAL_STATES:
            self.rows.append(
                _Row(entry, "system", "not settled: the task has not ended", apply=False)
            )
            return
        self.set(settled_at=timezone.now())
        self._unpark("the task has ended; nothing is left to watch")
        self.rows.append(_Row(entry, "system", entry.note or _system_note(payload)))

    def _unpark(self, note: str) -> None:
        """A parked task that ends (settled by an operator's cancel or refresh, or a send
        withdrawn) has nothing left to watch: it is idle, as a holder's release would have
        left it. It said "parked" for ever, its alert open and the task never pruned. A task
        a holder has is left to that holder."""
        if self.get("watcher_status") == RemoteTask.WatcherStatus.PARKED and not self.get(
            "lease_token"
        ):
            self.set(
                watcher_status=RemoteTask.WatcherStatus.IDLE,
                watcher_note=note,
                watcher_since=timezone.now(),
                lease_expires_at=None,  # the parked hold-off
            )
            # Written only if still so: a holder taking the task meanwhile (watch again)
            # makes the write match no row, and the batch is folded again on its row.
            self.expect.update(watcher_status=RemoteTask.WatcherStatus.PARKED, lease_token="")

    def _fold_operator(self, entry: Entry) -> None:
        """An operator's action; a message we send joins the conversation."""
        row = _Row(entry, "operator")
        if entry.payload.get("action") == "retry" and self.get("phase") == RemoteTask.Phase.FAILED:
            self.set(phase=RemoteTask.Phase.SENDING)
        message = entry.payload.get("message")
        context = message.get("contextId") if isinstance(message, dict) else None
        if (
            entry.payload.get("action") == "start"
            and isinstance(context, str)
            and not self.get("context_id")
        ):
            # The context we chose is known from the start: an import that lists the task
            # before its reply is recorded finds this row by it (services/imports.py).
            self.set(context_id=context[:300])
        if isinstance(message, dict) and message.get("messageId"):
            row.messages = self.unknown_messages([message])  # type: ignore[attr-defined]
            self.remember_messages(row.messages)  # type: ignore[attr-defined]
            # Logged with password-field values hidden (tasks.answer_task's ``logged``).
            row.typed_values_hidden = "hidden" in entry.payload  # type: ignore[attr-defined]
        self.rows.append(row)

    # -- writes
    def build_events(self, first_seq: int, now: datetime, actor_id: int | None) -> list[TaskEvent]:
        """The log rows to append, each hashed onto the one before (the task's chain).

        Also notes the seq of a new question (``asked_seq``), and when the wait for an
        answer began (``question_since``), before the compare-and-set writes the snapshot.
        """
        events = []
        stored_here: list[dict] = []  # messages this batch's rows store, in order
        previous_state, previous_hash = self.initial_state, self.task.last_hash
        received_text = timestamp_text(now)
        for seq, row in enumerate(self.rows, start=first_seq):
            if not row.entry.digest:  # entries the fold made itself (gaps, notices)
                row.entry.digest, row.entry.size = content_digest(row.entry.raw)
            note = row.note
            if row.entry.note and row.entry.note != note:
                note = f"{note}; {row.entry.note}" if note else row.entry.note
            raw, raw_digest = row.entry.raw, row.entry.digest
            if row.entry.size > self.inline_limit:  # else no content is over it
                # Big part contents live once, in the part rows and the conversation rows; the
                # log keeps a reference.
                moved = in_messages = 0
                if row.apply and row.kind in ("artifactUpdate", "task"):
                    raw, moved = by_reference(raw)
                held = self._conversation_copies(row, stored_here)
                kept = big_contents(held, self.inline_limit)
                if kept:
                    raw, in_messages = messages_by_reference(raw, kept)
                if moved or in_messages:
                    raw_digest, _ = content_digest(raw)
                for count, where in ((moved, "part"), (in_messages, "message")):
                    if count:
                        home = "the artifact" if where == "part" else "the conversation"
                        moved_note = f"{count} characters of {where} {STORED_ONCE}, in {home}"
                        note = f"{note}; {moved_note}" if note else moved_note
            if row.apply:
                stored_here.extend(getattr(row, "messages", ()))
            previous_hash = chain_hash(previous_hash, row_text(
                seq=seq, received_text=received_text, channel=self.channel, kind=row.kind,
                raw_digest=raw_digest, note=note, state_after=row.state_after, actor_id=actor_id,
            ))  # fmt: skip
            # In EVENT_FIELDS order, without Model.__init__ (see _row_maker).
            events.append(_new_event(
                None, self.task.pk, seq, now, self.channel, row.kind, raw, row.state_after,
                row.state_after != previous_state or seq == 1, note, actor_id, row.entry.digest,
                previous_hash,
            ))  # fmt: skip
            if row.apply and row.asks:
                if not (
                    previous_state in INTERRUPTED_STATES
                    and self.get("answered_seq") < self.get("asked_seq")
                ):
                    # A new wait: asked again while unanswered, it goes on (the alert and
                    # the inbox count it from here, however often the agent repeats it).
                    self.set(question_since=now)
                self.set(asked_seq=seq, asked_at=now)
            previous_state = row.state_after
        return events

    def _conversation_copies(self, row: _Row, stored_here: list[dict]) -> list[dict]:
        """The conversation's copy of each message ``row`` carries (by id; the conversation
        keeps an id's first content): stored before this batch (read), by an earlier row of
        it (``stored_here``, written after the log rows), or by this row itself.

        An agent repeats messages: a snapshot's history carries the operator's first message
        (and its file) on every GetTask, a stream's first Task event too. Each such row kept
        the file whole again; now it refers to the conversation's copy where that is the very
        content (``messages_by_reference`` compares each content's sha256).
        """
        carried = {m["messageId"] for m in _messages_in(row.entry)}
        mine = getattr(row, "messages", []) if row.apply else []
        copies = {m["messageId"]: m for m in stored_here if m["messageId"] in carried}
        for message in mine:
            copies.setdefault(message["messageId"], message)
        copies.update(self._stored_copies(carried - copies.keys()))
        return list(copies.values())

    def _stored_copies(self, ids: Collection[str]) -> dict[str, dict]:
        """The conversation rows stored before this batch for ``ids`` that hold a content over
        ``INLINE_CONTENT_BYTES`` (the others can be no reference's home), read once a fold."""
        cache = self._copies
        missing = sorted(aid for aid in ids if aid not in cache)
        for start in range(0, len(missing), LOOKUP_SLICE):
            chunk = missing[start : start + LOOKUP_SLICE]
            cache.update(dict.fromkeys(chunk))
            cache.update(
                ConversationMessage.objects.filter(task_id=self.task.pk, message_id__in=chunk)
                .annotate(size=Length(Cast("message", models.TextField())))
                .filter(size__gt=self.inline_limit)  # only those with a content over it
                .order_by()
                .values_list("message_id", "message")
            )
        return {aid: cache[aid] for aid in ids if cache.get(aid) is not None}

    def write_rows(
        self, events: list[TaskEvent], now: datetime, applied: Callable[[], None] | None = None
    ) -> None:
        """Append the log rows and apply them to the snapshot's rows.

        Writes are gathered and made in bulk at the end: a batch of any size
        costs a handful of statements (events, parts, messages, artifacts).
        ``applied`` is called once the rows are applied in memory, before the bulk writes.
        """
        self._new_parts: list[ArtifactPart] = []
        self._new_messages: list[ConversationMessage] = []
        self._touched: dict[str, Artifact] = {}
        self._replaced: dict[str, str] = {}
        for row, event in zip(self.rows, events, strict=True):
            if row.apply:
                self._apply_row(row, event.seq, now)
        if applied is not None:
            applied()
        if self._replaced:
            ReplacedContent.objects.bulk_create(
                [
                    ReplacedContent(task_id=self.task.pk, sha256=digest, content=content)
                    for digest, content in self._replaced.items()
                ],
                ignore_conflicts=True,  # the same content replaced before
            )
        # A row that keeps its entry's raw as it came is written from the entry's canonical
        # text (parsing wrote it for the digest), not serialized a second time.
        texts = [
            row.entry.text.decode("ascii")
            if event.raw is row.entry.raw and row.entry.text is not None
            else None
            for row, event in zip(self.rows, events, strict=True)
        ]
        insert_rows(TaskEvent, events, json_texts={"raw": texts})
        insert_rows(
            ArtifactPart,
            self._new_parts,
            batch_size=500,
            json_texts={"part": [p.__dict__.get(PART_TEXT) for p in self._new_parts]},
        )
        insert_rows(ConversationMessage, self._new_messages, batch_size=500)
        names = ["name", "description", "metadata", "extensions", "part_count",
                 "digest", "complete", "position", "updated_seq", "updated_at"]  # fmt: skip
        if len(self._touched) == 1:
            # One artifact (a stream's usual batch): a plain UPDATE, not bulk_update's CASE per field.
            (artifact,) = self._touched.values()
            Artifact.objects.filter(pk=artifact.pk).update(
                **{name: getattr(artifact, name) for name in names}
            )
        elif self._touched:
            Artifact.objects.bulk_update(list(self._touched.values()), names)

    def _apply_row(self, row: _Row, seq: int, now: datetime) -> None:
        for message in getattr(row, "messages", []):
            self._new_messages.append(
                ConversationMessage(
                    task_id=self.task.pk,
                    message_id=message["messageId"],
                    role=str(message.get("role", ""))[:20],  # the column's length
                    message=message,
                    seq=seq,
                    created_at=now,
                    typed_values_hidden=getattr(row, "typed_values_hidden", False),
                )
            )
        if row.kind == "task" and getattr(row, "replace_artifacts", False):
            artifacts = row.artifacts  # type: ignore[attr-defined]
            self._replace_all_artifacts(
                artifacts, seq, now, ended=row.state_after in TERMINAL_STATES
            )
        elif row.kind == "artifactUpdate":
            update = row.entry.payload
            data = update["artifact"]
            append = bool(update.get("append")) and self.artifact(data["artifactId"]) is not None
            artifact = self._put_artifact(data, seq, now, complete=bool(update.get("lastChunk")))
            self._add_parts(
                artifact,
                data.get("parts") or [],
                seq,
                replace=not append,
                chained=row.chained,
                texts=row.part_texts,
            )

    def _replace_all_artifacts(
        self, artifacts: list[dict], seq: int, now: datetime, *, ended: bool
    ) -> None:
        """Make the artifacts those of a snapshot; complete when the task had ended at its row
        (``ended``: the row's own state, not the batch's last, so a batch folds as one by one)."""
        held = self.artifacts()
        gone = [aid for aid in held if aid not in {a["artifactId"] for a in artifacts}]
        if gone:
            gone_pks = {held[aid].pk for aid in gone}
            self._keep_replaced(gone_pks)
            Artifact.objects.filter(pk__in=gone_pks).delete()
            # Parts queued earlier in this batch for an artifact now removed are not written.
            self._new_parts = [p for p in self._new_parts if p.artifact_id not in gone_pks]
            for aid in gone:
                del held[aid]
                self._touched.pop(aid, None)
        for position, data in enumerate(artifacts):
            parts = data.get("parts") or []
            current = held.get(data["artifactId"])
            if current is not None and current.digest == chain_digest("", parts):
                after = labels_after(labels_of(current), data)
                if current.position != position or labels_of(current) != after:
                    # Kept, but in the snapshot's place (positions stay distinct: the view is
                    # ordered by them, and follows the agent's order) and with its labels.
                    current.position = position
                    current.name, current.description, current.metadata, current.extensions = after
                    self._touched[current.artifact_id] = current
                continue
            artifact = self._put_artifact(data, seq, now, position=position, complete=ended)
            self._add_parts(artifact, parts, seq, replace=True)

    def _put_artifact(
        self,
        data: dict,
        seq: int,
        now: datetime,
        *,
        position: int | None = None,
        complete: bool = False,
    ) -> Artifact:
        """The artifact's row, updated in memory; a new one is inserted at once (parts need its pk)."""
        artifact = self.artifact(data["artifactId"])
        if artifact is None:
            artifact = Artifact(
                task_id=self.task.pk,
                artifact_id=data["artifactId"],
                position=self._next_place() if position is None else position,
            )
        elif position is not None:
            artifact.position = position
        artifact.name, artifact.description, artifact.metadata, artifact.extensions = labels_after(
            labels_of(artifact), data
        )
        artifact.complete = complete
        artifact.updated_seq = seq
        artifact.updated_at = now
        if artifact.pk is None:
            artifact.save()
            self._absent.discard(artifact.artifact_id)
        self._artifacts[artifact.artifact_id] = artifact
        self._touched[artifact.artifact_id] = artifact
        return artifact

    def _keep_replaced(self, artifact_pks: set[int]) -> None:
        """Before these artifacts' part rows go: the big contents that log rows refer to
        (``by_reference``), stored and queued in this batch alike, are kept apart
        (``ReplacedContent``). The part row was their only copy."""
        limit = self.inline_limit
        stored = (
            ArtifactPart.objects.filter(artifact_id__in=artifact_pks)
            .annotate(size=Length(Cast("part", models.TextField())))
            .filter(size__gt=limit)  # its JSON text is at least as long as any content in it
            .values_list("part", flat=True)
        )
        queued = [p.part for p in self._new_parts if p.artifact_id in artifact_pks]
        for part in [*stored, *queued]:
            for content in contents_over([part], limit):
                self._replaced[_sha256(content)] = content

    def _next_place(self) -> int:
        """A new artifact's place: after every one the task holds (places are 0 to n - 1)."""
        if self._whole:
            return len(self._artifacts)
        # Those made earlier in this transaction included; one count per new artifact, which
        # costs an INSERT of its own anyway.
        return Artifact.objects.filter(task_id=self.task.pk).count()

    def _add_parts(
        self,
        artifact: Artifact,
        parts: list,
        seq: int,
        *,
        replace: bool,
        chained: tuple[str, str] | None = None,
        texts: list[str] | None = None,
    ) -> None:
        if replace:
            if artifact.part_count:
                self._keep_replaced({artifact.pk})
            ArtifactPart.objects.filter(artifact=artifact).delete()
            self._new_parts = [p for p in self._new_parts if p.artifact_id != artifact.pk]
            artifact.part_count, artifact.digest = 0, ""
        start = artifact.part_count
        # In PART_FIELDS order (see _row_maker).
        rows = [_new_part(None, artifact.pk, start + i, part, seq) for i, part in enumerate(parts)]
        if texts is not None and len(texts) == len(rows):
            for row, text in zip(rows, texts, strict=True):
                row.__dict__[PART_TEXT] = text
        self._new_parts.extend(rows)
        artifact.part_count = start + len(parts)
        if chained is not None and chained[0] == artifact.digest:
            artifact.digest = chained[1]  # the same parts onto the same digest: the fold's result
        else:
            artifact.digest = chain_digest(artifact.digest, parts)


# The constructor's positional order of the rows built in bulk (checked in tests/test_chain.py).
EVENT_FIELDS = ("id", "task_id", "seq", "received_at", "channel", "kind", "raw", "state_after",
                "state_changed", "note", "actor_id", "digest", "hash")  # fmt: skip
PART_FIELDS = ("id", "artifact_id", "index", "part", "seq")

M = TypeVar("M", bound=models.Model)


def _row_maker(model: type[M], attnames: tuple[str, ...]) -> Callable[..., M]:
    """A maker of new, unsaved ``model`` rows from values in ``attnames`` order.

    What ``Model.__init__`` leaves for positional values (each field's value set,
    a fresh state), without its generic work: a fast stream's batch builds one
    log row per event and one part row per chunk, and ``__init__`` was about 4 us
    of each (against 1 us, measured). Only for these models, which nothing
    listens to at construction (no ``pre_init``/``post_init`` receivers, checked
    in tests/test_chain.py).
    """

    def make(*values: Any) -> M:
        row = model.__new__(model)
        row._state = ModelState()
        row.__dict__.update(zip(attnames, values, strict=True))
        return row

    return make


_new_event = _row_maker(TaskEvent, EVENT_FIELDS)
_new_part = _row_maker(ArtifactPart, PART_FIELDS)
# A new part row's canonical JSON text, when the fold wrote it (``chain_digest``): the insert
# writes it as it is (``json_texts``), not serialized a second time.
PART_TEXT = "_json_text"

_AS_IS = (int, str, bool)
# COPY takes two round trips (the statement, then the rows): a few rows, as a live stream's
# single events, go faster as one INSERT.
COPY_FROM_ROWS = 10


def insert_rows(
    model: type[models.Model],
    objs: list[Any],
    *,
    batch_size: int | None = None,
    json_texts: dict[str, list[str | None]] | None = None,
) -> None:
    """Insert new rows of ``model`` in bulk, in the current transaction.

    On PostgreSQL the rows go through ``COPY ... FROM STDIN``: the same values
    (each field's ``pre_save`` and ``get_db_prep_save``, as ``bulk_create``
    prepares them) without building one statement of thousands of placeholders,
    which Django's compiler and psycopg's client-side binding spent most of a
    fast stream's write time on (profiled, P3). The primary keys are not read
    back: nothing after a record needs them. Fewer than ``COPY_FROM_ROWS`` rows, and
    other databases: ``bulk_create`` (``batch_size``).

    ``json_texts``: for a JSON field (by attname), each row's value as JSON text already
    written (None: serialize the value), used by COPY and by ``bulk_create`` alike; a text
    must be JSON of that very value (the rows keep the value).
    """
    if not objs:
        return
    if json_texts and (
        connection.vendor == "sqlite"
        or (connection.vendor == "postgresql" and len(objs) < COPY_FROM_ROWS)
    ):
        _bulk_create_with_texts(model, objs, batch_size, json_texts)
        return
    if connection.vendor != "postgresql" or len(objs) < COPY_FROM_ROWS:
        model.objects.bulk_create(objs, batch_size=batch_size)
        return
    # The connection itself, not its proxy: preparing a JSON value asks the connection for
    # its operations, a thread-local lookup per value through the proxy.
    wrapper = connections[DEFAULT_DB_ALIAS]
    fields = [f for f in model._meta.concrete_fields if not f.primary_key]
    plain = [not isinstance(f, models.JSONField) for f in fields]
    given = json_texts or {}
    skipped = [f.attname in given for f in fields]  # filled in from the texts below
    rows = [
        [
            # A plain int, str or bool (exact types), or an aware datetime, is its own
            # database value for every field but JSON (``get_db_prep_save`` returns it as is).
            value
            if skip
            or (simple and (type(value) in _AS_IS or (type(value) is datetime and value.tzinfo)))
            else f.get_db_prep_save(value, wrapper)
            for f, simple, skip in zip(fields, plain, skipped, strict=True)
            for value in (None if skip else f.pre_save(obj, True),)
        ]
        for obj in objs
    ]
    for name, texts in given.items():
        index = next(i for i, f in enumerate(fields) if f.attname == name)
        for row, text, obj in zip(rows, texts, objs, strict=True):
            # COPY's text form of a JSON column is parsed as JSON: a text at hand is written
            # as it is, and only a row without one is serialized.
            row[index] = (
                text
                if text is not None
                else fields[index].get_db_prep_save(getattr(obj, name), wrapper)
            )
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    statement = f"COPY {connection.ops.quote_name(model._meta.db_table)} ({columns}) FROM STDIN"
    with (
        connection.cursor() as cursor,
        connection.wrap_database_errors,
        cursor.cursor.copy(statement) as copy,
    ):
        for row in rows:
            copy.write_row(row)
    alias = wrapper.alias  # read once: through the proxy it was a thread-local lookup per row
    for obj in objs:
        obj._state.adding, obj._state.db = False, alias


def _bulk_create_with_texts(
    model: type[models.Model],
    objs: list[Any],
    batch_size: int | None,
    json_texts: dict[str, list[str | None]],
) -> None:
    """``bulk_create``, each JSON value whose text is at hand written as that text.

    The recorder wrote each entry's canonical text for its digest, and serializing the
    entry again was about a twentieth of a fast stream's batch on SQLite (profiled, P3),
    which keeps JSON as text. On PostgreSQL this is the path of a batch too small for COPY
    (a live stream's single events): the text goes as a literal that the column parses as
    JSON. The rows hold their values again afterwards, whatever happens.
    """
    swapped: list[tuple[Any, str, Any]] = []
    try:
        for name, texts in json_texts.items():
            for obj, text in zip(objs, texts, strict=True):
                if text is not None:
                    swapped.append((obj, name, obj.__dict__[name]))
                    obj.__dict__[name] = JSONText(text)
        model.objects.bulk_create(objs, batch_size=batch_size)
    finally:
        for obj, name, value in swapped:
            obj.__dict__[name] = value


# 3. The transaction, and the relay after it --------------------------------------------------

# Channels that carry what an agent said: the agent still holds it, and a watcher that finds
# the mirror behind reads it again (a gap row says so).
AGENT_CHANNELS = ("send-response", "stream", "resubscribe", "poll", "push")


def relax_commit(channel: str) -> None:
    """On PostgreSQL, let this transaction commit without waiting for the WAL flush.

    Only for what agents say (``AGENT_CHANNELS``) and with ``RECORD_ASYNC_COMMIT``
    (the default): the flush was most of a live event's time in the worker (about
    8 ms a commit on the bench machine's disk, profiled for P1), and SQLite is run
    with the same guarantee (WAL, ``synchronous=NORMAL``): a crash of the database
    server may lose the last fraction of a second of commits, never part of one.
    Operators' and the system's own entries keep waiting for the flush.
    """
    if not _relaxed(channel):
        return
    if sent_ahead.usable():  # with the transaction's BEGIN: one round trip, as TaskRead's
        sent_ahead.SentAhead(RELAX, []).results()
        return
    with connection.cursor() as cursor:
        cursor.execute(RELAX)


RELAX = "SET LOCAL synchronous_commit TO OFF"


def _relaxed(channel: str) -> bool:
    return (
        settings.RECORD_ASYNC_COMMIT
        and channel in AGENT_CHANNELS
        and connection.vendor == "postgresql"
    )


def read_task(
    task_pk: int, *, relax: bool = False, artifacts: bool | Collection[str] = False
) -> tuple[RemoteTask | None, dict[str, Artifact] | None]:
    """The task's row as a fold starts from it (None: no such task), in the current
    transaction, and its artifacts by id (None: not read here): all of them with
    ``artifacts=True``, or those of the ids given (a batch of chunks needs no others)."""
    return TaskRead(task_pk, relax=relax, artifacts=artifacts).result()


class TaskRead:
    """The first read of a fold (see :func:`read_task`), begun when made, taken by
    :meth:`result`.

    The statements are compiled once per connection: a fast stream's batch is a dozen
    statements, and compiling ``get()`` and the artifacts' query each time was about
    a sixth of its time on PostgreSQL (profiled, P3; on SQLite the read fell from
    13-15 to 8-11 us an event). On PostgreSQL they go in one round trip, with the
    ``SET LOCAL`` of :func:`relax_commit` when ``relax``, and are sent when the read is
    made (:mod:`.sent_ahead`): what the caller does before :meth:`result` (``record_many``
    parses its batch) overlaps the round trip. Elsewhere they run in :meth:`result`.
    Exactly one of :meth:`result` and :meth:`discard` must be called.
    """

    def __init__(
        self, task_pk: int, *, relax: bool = False, artifacts: bool | Collection[str] = False
    ) -> None:
        reads = getattr(connection, "_dashboard_reads", None)
        if reads is None:
            reads = connection._dashboard_reads = _Reads(connection)  # type: ignore[attr-defined]
        self.reads = reads
        self.whole = artifacts is True
        self.named = set(artifacts) if artifacts is not True and artifacts else set()
        self.artifacts = bool(artifacts)
        self.artifacts_sql, self.artifacts_params = (
            reads.artifacts.sql,
            [task_pk, *sorted(self.named)],
        )
        if self.named:
            marks = ", ".join(["%s"] * len(self.named))
            self.artifacts_sql += f" AND {reads.artifact_id} IN ({marks})"
        self.task_pk = task_pk
        self.relax = relax and connection.vendor == "postgresql"
        self.ahead: sent_ahead.SentAhead | None = None
        if connection.vendor == "postgresql" and sent_ahead.usable():
            sql, params = self._statements()
            self.ahead = sent_ahead.SentAhead(sql, params)

    def _statements(self) -> tuple[str, list]:
        statements = [RELAX] if self.relax else []
        statements.append(self.reads.task.sql)
        params: list = [self.task_pk]
        if self.artifacts:
            statements.append(self.artifacts_sql)
            params += self.artifacts_params
        return "; ".join(statements), params

    def result(self) -> tuple[RemoteTask | None, dict[str, Artifact] | None]:
        reads = self.reads
        if self.ahead is not None:
            results = self.ahead.results()[int(self.ahead.began) + int(self.relax) :]
            found = reads.task.instances(self.ahead.rows(results[0]))
            if not self.artifacts or not found:
                return (found[0] if found else None), None
            held = reads.artifacts.instances(self.ahead.rows(results[1]))
            return found[0], {artifact.artifact_id: artifact for artifact in held}
        with connection.cursor() as cursor:
            if connection.vendor != "postgresql":
                cursor.execute(reads.task.sql, [self.task_pk])
                found = reads.task.rows(cursor)
                if self.artifacts and found:
                    cursor.execute(self.artifacts_sql, self.artifacts_params)
            else:
                # Several statements with parameters in one execute: Django's default
                # client-side binding on psycopg 3 (a server-side-binding cursor would
                # refuse it).
                sql, params = self._statements()
                cursor.execute(sql, params)
                if self.relax:
                    cursor.nextset()
                found = reads.task.rows(cursor)
                if self.artifacts:
                    cursor.nextset()
            if not self.artifacts or not found:
                return (found[0] if found else None), None
            held = reads.artifacts.rows(cursor)
        return found[0], {artifact.artifact_id: artifact for artifact in held}

    def discard(self) -> None:
        """The caller failed before :meth:`result`: drop what was sent ahead."""
        if self.ahead is not None:
            self.ahead.discard()


class _Compiled:
    """A query of one model filtered on one value, compiled once: SQL, columns, converters."""

    def __init__(self, queryset: models.QuerySet, wrapper: Any) -> None:
        self.model = queryset.model
        self.compiler = queryset.query.get_compiler(connection=wrapper)
        sql, params = self.compiler.as_sql()
        assert list(params) == [0], params
        self.sql = sql
        fields = self.compiler.klass_info["select_fields"]
        self.span = (fields[0], fields[-1] + 1)
        self.attnames = [
            column[0].target.attname for column in self.compiler.select[slice(*self.span)]
        ]
        # The JSON fields' decoding; results_iter() would look these up again on every call.
        columns = [column[0] for column in self.compiler.select[: self.compiler.col_count]]
        self.converters = self.compiler.get_converters(columns)

    def rows(self, cursor: Any) -> list[Any]:
        """The instances of the current result of ``cursor``."""
        return self.instances(cursor.fetchall())

    def instances(self, raw: Any) -> list[Any]:
        """The instances of rows as the database driver loaded them."""
        if self.converters:
            raw = self.compiler.apply_converters(raw, self.converters)
        start, end = self.span
        alias = connection.alias
        return [self.model.from_db(alias, self.attnames, row[start:end]) for row in raw]


class _Reads:
    """What a fold reads first, compiled once per connection (see :class:`TaskRead`)."""

    def __init__(self, wrapper: Any) -> None:
        self.task = _Compiled(RemoteTask.objects.filter(pk=0).order_by(), wrapper)
        self.artifacts = _Compiled(Artifact.objects.filter(task_id=0).order_by(), wrapper)
        # Ids are appended to its WHERE (see TaskRead): it must end there.
        assert " ORDER BY " not in self.artifacts.sql and " LIMIT " not in self.artifacts.sql
        quote = wrapper.ops.quote_name
        self.artifact_id = f"{quote(Artifact._meta.db_table)}.{quote('artifact_id')}"


def record(
    task: RemoteTask | int,
    obj: Any,
    channel: str,
    *,
    actor_id: int | None = None,
    gap_check: bool | None = None,
    fence: str | None = None,
) -> Recorded:
    """Record one object learned about ``task`` through ``channel``."""
    return record_many(task, [obj], channel, actor_id=actor_id, gap_check=gap_check, fence=fence)


def _within_event_limit(entry: Entry, limit: int) -> Entry:
    """An agent's entry over ``WATCH_MAX_EVENT_BYTES`` becomes a protocol error, not kept.

    A stream's events are refused at that size as they are read; a GetTask or ListTasks
    reply (up to 32 MiB) and a push body reach here whole, so the bound is kept here too.
    """
    if entry.kind not in A2A_KINDS or entry.size <= limit:
        return entry
    return parse_entry(
        {
            "protocolError": {
                "message": f"{entry.kind} of {entry.size:,} bytes, over the {limit:,}-byte "
                "limit (WATCH_MAX_EVENT_BYTES): not kept",
                "digest": entry.digest,
            }
        }
    )


def record_many(
    task: RemoteTask | int,
    objs: Sequence[Any] | Batch,
    channel: str,
    *,
    actor_id: int | None = None,
    gap_check: bool | None = None,
    fence: str | None = None,
    at: datetime | None = None,
    ahead: Batch | None = None,
) -> Recorded:
    """Record several objects, in order, in one transaction (cheaper for fast streams).

    ``gap_check``: a snapshot that differs from the mirror means events were
    missed (true by default on the ``resubscribe`` channel, and on ``poll`` for
    a task watched by stream, where a poll only happens when no stream was
    live; watchers also set it for the GetTask that settles a task).

    ``fence``: the writer's lease token. A watcher passes its own; when the
    task's lease has moved on (another holder took over), nothing is written
    and the result says ``fenced``. The check is part of the compare-and-set,
    so a holder that lost its lease in the middle of a batch cannot write.

    ``at``: when the objects were received (now by default). ``audit replay`` passes the
    stored rows' time: a status time is judged against it (``CLOCK_AHEAD``), and a replay
    a day later must fold as the recording did.

    ``ahead``: the objects of the caller's next call, as a :class:`Batch`. While this call
    waits on PostgreSQL (:mod:`.waits`) they are parsed, then folded from the task as this
    call leaves it (:class:`_FoldAhead`); that call, given the same batch, takes what was
    made when it still holds. What is recorded does not change, only when it is worked out.
    """
    task_pk = task if isinstance(task, int) else task.pk
    batch = objs if isinstance(objs, Batch) else Batch(objs)
    for attempt in range(MAX_RETRIES):
        with waits.meanwhile(ahead):
            recorded = _record_once(
                task_pk, batch, channel, gap_check, actor_id, fence, at, ahead=ahead
            )
        if recorded is not None:
            return recorded
        # Another writer appended first: fold again on its result, after a short
        # random pause so that the same writers do not collide again and again.
        time.sleep(random.uniform(0, 0.001 * min(attempt + 1, 20)))
    raise RecordError(f"task {task_pk}: gave up after {MAX_RETRIES} concurrent updates")


class Batch:
    """The objects of one ``record_many()`` call, parsed once: ahead, while an earlier call
    waited on the database (its ``ahead``), or in the call's first try, while the task's
    read is on its way (:class:`TaskRead`), whichever comes first; a batch parsed part of
    the way ahead is finished there."""

    def __init__(self, objs: Sequence[Any]) -> None:
        self.objs = objs
        self._done: list[Entry] = []
        self.entries: list[Entry] | None = None if objs else []
        # Its fold, made in the previous call's waits (see _record_once): taken if it holds.
        self.folded_ahead: _FoldAhead | None = None

    @property
    def pending(self) -> bool:
        """Whether objects are left to parse (:class:`.waits.Work`)."""
        return self.entries is None

    def step(self) -> None:
        """Parse the next object."""
        done = self._done
        done.append(parse_entry(self.objs[len(done)]))
        if len(done) == len(self.objs):
            self.entries = _within_limits(done)

    def parse(self) -> list[Entry]:
        while self.entries is None:
            self.step()
        return self.entries

    def read(
        self, task_pk: int, *, relax: bool
    ) -> tuple[RemoteTask | None, dict[str, Artifact] | None, bool, set[str]]:
        """The task as a fold starts from it, with the artifacts its entries name (all of
        them for a snapshot, which compares every one; chunks need only their own), and
        what was read of them: (task, artifacts by id, all of them, the ids asked for).

        1. In the first try, unless parsed ahead, the artifacts are told from the objects
           as they came, the read is sent, and the objects are parsed (what is left of
           them) while it is on its way.
        2. The parsed entries say what the fold needs. A guess that missed some of it
           (an object that parsing changed or refused) is read again, exactly.
        """
        if self.entries is None:  # 1
            whole, named = _artifacts_guessed(self.objs)
            read = TaskRead(task_pk, relax=relax, artifacts=whole or named)
            try:
                self.parse()
            except BaseException:
                read.discard()
                raise
            current, held = read.result()
            whole, named = _artifacts_named(self.entries)  # 2
            if read.whole or (not whole and named <= read.named):
                return current, held, read.whole, read.named
        else:
            whole, named = _artifacts_named(self.entries)
        current, held = TaskRead(task_pk, relax=relax, artifacts=whole or named).result()
        return current, held, whole, named


def _artifacts_named(entries: Sequence[Entry]) -> tuple[bool, set[str]]:
    """Whether ``entries`` hold a snapshot, and the artifact ids their chunks name."""
    whole, named = False, set()
    for entry in entries:
        if entry.kind == "task":
            whole = True
        elif entry.kind == "artifactUpdate":
            named.add(entry.payload["artifact"]["artifactId"])
    return whole, named


def _artifacts_guessed(objs: Sequence[Any]) -> tuple[bool, set[str]]:
    """What :func:`_artifacts_named` will say of ``objs`` once parsed, told from the objects
    as they came. Only ids a database can take are kept: parsing cleans the others (a lone
    surrogate, a NUL), and the exact read after it asks for them as cleaned."""
    whole, named = False, set()
    for obj in objs:
        obj = getattr(obj, "raw", obj)
        if not isinstance(obj, dict):
            continue
        if obj.get("task") is not None:
            whole = True
        update = obj.get("artifactUpdate")
        artifact = update.get("artifact") if isinstance(update, dict) else None
        aid = artifact.get("artifactId") if isinstance(artifact, dict) else None
        if isinstance(aid, str) and safejson.clean_text(aid) == aid:
            named.add(aid)
    return whole, named


def _within_limits(entries: list[Entry]) -> list[Entry]:
    limit = settings.WATCH_MAX_EVENT_BYTES
    if any(entry.size > limit and entry.kind in A2A_KINDS for entry in entries):
        entries = [_within_event_limit(entry, limit) for entry in entries]
    return entries


def _record_once(
    task_pk: int,
    batch: Batch,
    channel: str,
    gap_check: bool | None,
    actor_id: int | None,
    fence: str | None,
    at: datetime | None = None,
    ahead: Batch | None = None,
) -> Recorded | None:
    """One try: fold and append in one transaction; None when another writer won the race.

    The fold may have been made ahead (:class:`_FoldAhead`), in the previous call's waits,
    from the task as that call left it: it is taken when the task and artifacts read now
    are those it started from, and the call's arguments the same; else it is made here.
    """
    given = (channel, gap_check, actor_id, fence, at)
    with transaction.atomic():
        current, held, whole, named = batch.read(task_pk, relax=_relaxed(channel))
        entries = batch.entries
        assert entries is not None
        if current is None:
            raise RecordError(f"task {task_pk} does not exist")
        if fence is not None and current.lease_token != fence:
            return Recorded(state=current.state, fenced=True)
        gap_check = _gap_check(gap_check, channel, current)
        made = batch.folded_ahead
        batch.folded_ahead = None
        if made is not None and made.started_from(current, held, whole, named, given):
            fold, a2ui_surfaces, now, events = made.finish()
        else:
            fold = _Fold(
                current, channel, gap_check=gap_check, fence=fence, artifacts=held, whole=whole,
                at=at,
            )  # fmt: skip
            fold.not_held(named)
            fold.prefetch_messages(entries)
            for entry in fold.without_typed_values(entries):
                fold.add(entry)
            a2ui_surfaces = surfaces.collect(fold)  # A2UI surfaces, and diagnoses as rows
            now, events = timezone.now(), None
        if not fold.rows:
            return Recorded(
                state=current.state, over_budget=fold.over_budget, repeated=fold.repeated
            )
        if events is None:
            events = fold.build_events(current.last_seq + 1, now, actor_id)
        changes = dict(
            fold.changes,
            last_seq=current.last_seq + len(fold.rows),
            last_hash=events[-1].hash,
            last_event_at=now,
            updated_at=now,
        )
        # Compare-and-set: matches no row if someone appended since we read.
        guard = {**fold.expect, **({"lease_token": fence} if fence is not None else {})}
        if not RemoteTask.objects.filter(pk=task_pk, last_seq=current.last_seq, **guard).update(
            **changes
        ):
            return None
        for name, value in changes.items():
            setattr(current, name, value)

        def fold_ahead() -> None:
            # The next call's fold, from the task and artifacts as this one leaves them, in
            # this call's waits (after the parsing of its objects: waits.then).
            if ahead is not None:
                made = _FoldAhead(ahead, current, fold, given)
                ahead.folded_ahead = made if waits.then(made) else None

        fold.write_rows(events, now, applied=fold_ahead)
        if a2ui_surfaces is not None:
            a2ui_surfaces.write(events, fold.rows)
        messages = _RelayMessages(current, events, fold.rows)
        waits.first(messages)  # made while the commit is awaited, where it is
        transaction.on_commit(lambda: relay.publish(messages.made()))
        transaction.on_commit(lambda: _count(current.agent_id, channel, events))
        return Recorded(
            seqs=[e.seq for e in events],
            state=current.state,
            notes=[e.note for e in events if e.note],
            kinds=[e.kind for e in events],
            over_budget=fold.over_budget,
            repeated=fold.repeated,
            news=any(row.apply and row.kind in A2A_KINDS for row in fold.rows),
        )


class _FoldAhead:
    """The fold of a call's batch made ahead, in the previous call's waits on PostgreSQL
    (:mod:`.waits`), from the task and artifacts as that call leaves them in memory.

    What the fold reads is all in what it starts from: the task's row, the artifacts the
    batch names, the entries, the call's arguments, and the time (``now``, which the rows
    then carry). :meth:`started_from` compares the first two with what the call reads in
    its transaction, and the arguments with its own; anything else the fold would read
    (the log, the conversation, artifacts not in hand) is a query, which a wait refuses
    (``waits.ConnectionBusy``): the work is dropped and the call folds for itself. So is a
    batch with a snapshot, which compares every artifact, or naming one not in hand.

    Steps, each small (a reply waits at most one): the start, one entry each, then the
    A2UI surfaces and the log rows.
    """

    def __init__(self, batch: Batch, task: RemoteTask, before: _Fold, given: tuple) -> None:
        # The batch holds this: a reference back would make a cycle of its entries and the
        # last call's fold, freed only by the cyclic collector (see ``_Rows``).
        self._batch = weakref.ref(batch)
        self.given = given
        self._task: RemoteTask | None = task
        self._before: _Fold | None = before
        self.fold: _Fold | None = None
        self.entries: list[Entry] = []
        self.added = 0
        self.surfaces: Any = None
        self.events: list[TaskEvent] | None = None
        self.done = self.failed = False

    @property
    def pending(self) -> bool:
        return not (self.done or self.failed)

    def step(self) -> None:
        try:
            if self.fold is None:
                self._start()
            elif self.added < len(self.entries):
                self.fold.add(self.entries[self.added])
                self.added += 1
            else:
                self._end()
        except BaseException:
            self.failed = True
            raise

    def _start(self) -> None:
        """1. The task and the artifacts the entries name, copied as the last call left them.
        2. The fold from them, with what a call does before its entries."""
        batch, last, before = self._batch(), self._task, self._before
        self._task = self._before = None  # what is needed is copied; the rest is let go
        entries = batch.entries if batch is not None else None
        if entries is None or last is None or before is None:
            raise _NotAhead("the batch is not parsed")
        whole, named = _artifacts_named(entries)
        if whole or not named <= before._artifacts.keys() | before._absent:
            raise _NotAhead("the batch needs artifacts not in hand")
        self.named = named
        task = copy.copy(last)  # 1
        held = {aid: copy.copy(before._artifacts[aid]) for aid in named if aid in before._artifacts}
        self.first_seq = task.last_seq + 1
        self.task_values = _row_values(task)
        self.held_values = {aid: _row_values(artifact) for aid, artifact in held.items()}
        channel, gap_check, _, fence, at = self.given
        gap_check = _gap_check(gap_check, channel, task)
        self.now = timezone.now()
        fold = _Fold(
            task, channel, gap_check=gap_check, fence=fence, artifacts=held, whole=False,
            at=at,
        )  # fmt: skip
        fold.not_held(named)  # 2
        fold.prefetch_messages(entries)
        self.entries = fold.without_typed_values(entries)
        self.fold = fold

    def _end(self) -> None:
        fold = self.fold
        assert fold is not None
        self.surfaces = surfaces.collect(fold)
        if fold.rows:
            actor_id = self.given[2]
            self.events = fold.build_events(self.first_seq, self.now, actor_id)
        self.done = True

    def started_from(
        self,
        task: RemoteTask,
        held: dict[str, Artifact] | None,
        whole: bool,
        named: set[str],
        given: tuple,
    ) -> bool:
        """Whether the call's task, artifacts and arguments are those this fold started
        from (an unfinished fold is finished by :meth:`finish`)."""
        return (
            self.fold is not None
            and not self.failed
            and given == self.given
            and not whole
            and named == self.named
            and _row_values(task) == self.task_values
            and {aid: _row_values(a) for aid, a in (held or {}).items()} == self.held_values
        )

    def finish(self) -> tuple[_Fold, Any, datetime, list[TaskEvent] | None]:
        while self.pending:
            self.step()
        assert self.fold is not None
        return self.fold, self.surfaces, self.now, self.events


def _gap_check(given: bool | None, channel: str, task: RemoteTask) -> bool:
    """``record_many``'s ``gap_check``, when not given: a snapshot after a time with no live
    stream, where what differs was not seen live."""
    if given is not None:
        return given
    return channel == "resubscribe" or (channel == "poll" and task.watch == RemoteTask.Watch.STREAM)


class _NotAhead(Exception):
    """The batch's fold cannot be made ahead; its call folds it."""


def _row_values(row: models.Model) -> tuple:
    """A row's column values as read (what a fold reads of it)."""
    return tuple(getattr(row, field.attname) for field in row._meta.concrete_fields)


def _count(agent_id: int, channel: str, events: list[TaskEvent]) -> None:
    """Metrics, after commit: entries appended, and the protocol errors among them."""
    metrics.count("events_recorded", len(events), channel=channel)
    metrics.count(
        "protocol_errors",
        sum(e.kind == TaskEvent.Kind.PROTOCOL_ERROR for e in events),
        agent=agent_id,
    )


def settle(
    task: RemoteTask | int, snapshot: dict | None, *, fence: str | None = None, note: str = ""
) -> Recorded:
    """Make an ended task final, after reconciling it once with the agent's GetTask.

    1. ``snapshot`` (the agent's GetTask, or None when it could not be read) is
       recorded on ``poll`` with the gap check on: where it differs from the
       view, a ``gap`` entry says what was not seen live and the view takes the
       agent's content (an ended task's state itself never changes).
    2. A ``system`` entry ``settled`` marks the task final, in the same
       transaction. From then on, anything that would change the view is
       logged as a ``protocol-error`` ("changed after the end") and changes
       nothing; a status from before the end is logged as older
       (``_Fold._from_before_the_end``), and changes nothing either.
    """
    objs: list[Any] = [{"task": snapshot}] if snapshot is not None else []
    detail = note or (
        "reconciled with the agent's GetTask" if snapshot is not None else "not reconciled"
    )
    objs.append({"system": {"event": "settled", "detail": detail[:2000]}})
    return record_many(task, objs, "poll", gap_check=True, fence=fence)


# The note of an entry naming a task another row mirrors (``_Fold._wrong_task``), before its id.
MIRRORED_ELSEWHERE = "is already mirrored as #"


def mirrored_elsewhere(agent_id: int, remote_id: str, task_pk: int) -> int | None:
    """The row of the agent, other than ``task_pk``, that mirrors ``remote_id`` (None: none)."""
    return (
        RemoteTask.objects.filter(agent_id=agent_id, remote_id=remote_id)
        .exclude(pk=task_pk)
        .values_list("pk", flat=True)
        .first()
    )


def named_task_id(raw: Any) -> str | None:
    """The task id an agent's entry names (a snapshot's ``id``, an update's ``taskId``)."""
    if not isinstance(raw, dict):
        return None
    for kind, key in (("task", "id"), ("statusUpdate", "taskId"), ("artifactUpdate", "taskId")):
        payload = raw.get(kind)
        if isinstance(payload, dict) and isinstance(payload.get(key), str):
            return payload[key]
    return None


# The note of a task nobody holds while its question waits (the watchers, the push drain).
WAITING_FOR_ANSWER = "waiting for an answer"


def settle_if_ended(task: RemoteTask | int, snapshot: dict, *, note: str) -> None:
    """Settle a task that ``snapshot`` (the agent's own Task: GetTask, CancelTask, ListTasks) ended.

    Operator actions and imports read the agent's truth directly, so a task that
    they find ended needs no watcher to settle it. Settling twice appends nothing.
    """
    task_pk = task if isinstance(task, int) else task.pk
    if RemoteTask.objects.filter(
        pk=task_pk, state__in=TERMINAL_STATES, settled_at__isnull=True
    ).exists():
        settle(task_pk, snapshot, note=note)
    # A push task settled here (a cancel, a refresh, an import, the push drain's GetTask) has
    # no watcher to end its "awaiting push": the page said so for ever, and retention (which
    # leaves awaited tasks alone) never pruned it. Nobody holds it: it is idle now.
    # So does one waiting for an answer: its note said so after the end.
    Status = RemoteTask.WatcherStatus
    if RemoteTask.objects.filter(
        Q(watcher_status=Status.AWAITING_PUSH)
        | Q(watcher_status=Status.IDLE, watcher_note=WAITING_FOR_ANSWER),
        pk=task_pk,
        lease_token="",
        settled_at__isnull=False,
    ).update(
        watcher_status=RemoteTask.WatcherStatus.IDLE,
        watcher_note="task ended",
        watcher_since=timezone.now(),
        lease_expires_at=None,
    ):
        from tasks_app.services.tasks import relay_watcher  # tasks imports this module

        relay_watcher(task_pk)  # the lists' rows said "awaiting push" until the next event


RELAY_RAW_LIMIT = 64 * 1024


class _RelayMessages:
    """One message per appended row (with its raw JSON unless large) and one list summary,
    made a few rows at a time (:class:`.waits.Work`: in the commit's wait on PostgreSQL)
    and finished by :meth:`made`.

    The row's raw JSON goes as text (``raw_json``), which the consumer splices into the
    browser's frame as it is (``TaskConsumer.task_event``): the channel layer packs and
    unpacks one string, not every object of the value (about 40% less time each), and an
    agent's integer past 64 bits, which msgpack cannot pack, no longer fails the send of
    every row beside it. A row that keeps the entry as it came takes the canonical text
    parsing wrote; another is written once here. Over ``RELAY_RAW_LIMIT`` the text is
    left out, and the consumer reads the row from the log.
    """

    ROWS_A_STEP = 16  # about 20 us: a reply waits no longer for one step

    def __init__(self, task: RemoteTask, events: list[TaskEvent], rows: list[_Row]) -> None:
        self.task, self.events, self.rows = task, events, rows
        self.messages: list[relay.Message] = []
        self.received_at = events[0].received_at.isoformat()  # one time for the batch's rows
        self.group = relay.task_group(task.pk)

    @property
    def pending(self) -> bool:
        return len(self.messages) < len(self.events)

    def step(self) -> None:
        done = len(self.messages)
        for event, row in zip(
            self.events[done : done + self.ROWS_A_STEP],
            self.rows[done : done + self.ROWS_A_STEP],
            strict=True,
        ):
            message = event_json(event, self.received_at)
            message["type"] = "task.event"
            del message["raw"]
            entry = row.entry
            if event.raw is entry.raw and entry.text is not None:
                text = entry.text
            elif event.raw is entry.raw and entry.size > RELAY_RAW_LIMIT:
                text = None  # its canonical size (ASCII escapes) bounds the row's: too large
            else:
                text = _canonical(event.raw)
            if text is not None and len(text) <= RELAY_RAW_LIMIT:
                message["raw_json"] = text.decode()
            self.messages.append((self.group, message))

    def made(self) -> list[relay.Message]:
        while self.pending:
            self.step()
        return [
            *self.messages,
            (relay.LIST_GROUP, {"type": "tasks.changed", **task_summary(self.task)}),
        ]


def task_summary(task: RemoteTask) -> dict:
    """The small picture of a task that lists and the overview show."""
    return {
        "task": task.pk,
        "agent": task.agent_id,
        "remote_id": task.remote_id,
        "context_id": task.context_id,
        "title": task.title,
        "phase": task.phase,
        "state": task.state,
        "last_seq": task.last_seq,
        "watcher_status": task.watcher_status,
        "updated_at": task.updated_at.isoformat() if task.updated_at else None,
    }


def next_seq_floor(task_pk: int) -> int:
    """The highest seq in the log (used by checks that the counter and the log agree)."""
    return TaskEvent.objects.filter(task_id=task_pk).aggregate(m=Max("seq"))["m"] or 0
