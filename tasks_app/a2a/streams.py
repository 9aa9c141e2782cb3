"""SSE framing and ``StreamResponse`` parsing.

The SSE reader is our own small bounded line reader rather than
``EventSource.aiter_sse()``: that one buffers a line of any length, and an
agent that never sends a newline would make us buffer without end. We still
open the request with ``httpx_sse.aconnect_sse`` (it sets the SSE request
headers). Comment lines (keep-alives) and events with empty data (a known
httpx-sse / framing quirk) are skipped.

Two clocks bound a stream besides httpx's read (idle) timeout, which only
notices silence: an event that has started must complete within
``event_deadline`` (:class:`DeadlineExceeded`), and complete events must
come at most ``event_gap`` apart (:class:`StreamIdleTimeout`), so an agent
that trickles keep-alives or a byte a second cannot hold a stream forever.
Time the consumer spends between events is not counted.

:func:`parse_stream_response` turns one decoded JSON object into a
:class:`StreamEvent`, rejecting shapes that are not A2A 1.0 (a 0.3-shaped payload:
``kind`` and no 1.0 member, or lower-case enums) with a :class:`ProtocolError` that
says what was wrong and where. Fields 1.0 does not know (a 0.3 ``kind`` or ``final``
an agent still sends beside the 1.0 shape) are ignored, as the spec asks (§5.7), and a
member that is ``null`` counts as not set (ProtoJSON).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from ._http import LARGE_BODY_BYTES, origin_of, take_large_body_slot
from .errors import DeadlineExceeded, PayloadTooLarge, ProtocolError, StreamIdleTimeout
from .types import ALL_ROLES, ALL_STATES, EVENT_KINDS, StreamEvent

DEFAULT_MAX_EVENT_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SSEMessage:
    """One dispatched SSE event (``event`` is ``""`` when the field was absent)."""

    event: str
    data: str


_EOL = re.compile(rb"\r\n|\r|\n")
# The SSE reader lets the event loop run at least once per this many lines.
LINES_PER_TURN = 1000
_LINE_BREAK_BYTES = b"\r\n"
_BOM = "\ufeff".encode()


class _Clock:
    """The two deadlines of one SSE reader, in event-loop time."""

    def __init__(self, event_deadline: float | None, event_gap: float | None, where: str):
        self.event_deadline = event_deadline
        self.event_gap = event_gap
        self.where = where
        self.now = asyncio.get_running_loop().time
        self.last_event = self.now()
        self.event_started: float | None = None

    @property
    def active(self) -> bool:
        return self.event_deadline is not None or self.event_gap is not None

    def line_started(self, first_byte: int) -> None:
        """A line began: unless it is a comment or blank, an event has started."""
        if self.event_started is None and first_byte != ord(":"):
            self.event_started = self.now()

    def event_done(self, *, dispatched: bool) -> None:
        self.event_started = None
        if dispatched:
            self.last_event = self.now()

    def paused(self, seconds: float) -> None:
        """The consumer held us for ``seconds``: that time is not the agent's."""
        self.last_event += seconds
        if self.event_started is not None:
            self.event_started += seconds

    def next_deadline(self) -> tuple[float, str] | None:
        bounds: list[tuple[float, str]] = []
        if self.event_gap is not None:
            bounds.append((self.last_event + self.event_gap, "gap"))
        if self.event_deadline is not None and self.event_started is not None:
            bounds.append((self.event_started + self.event_deadline, "event"))
        return min(bounds) if bounds else None

    def error(self, why: str) -> Exception:
        if why == "event":
            return DeadlineExceeded(
                f"{self.where}: no complete response after {self.event_deadline:g} s "
                "(an SSE event started and did not finish)"
            )
        return StreamIdleTimeout(
            f"{self.where}: no complete event for {self.event_gap:g} s "
            "(only keep-alives or partial data)"
        )


class _LargeEvent:
    """Takes a large body's slot (``_http.take_large_body_slot``) for an event past
    ``LARGE_BODY_BYTES``, before more of it is read.

    Bounded per stream alone (``max_event_bytes``), many streams of one agent each sending
    large events held them all at once, each about three times its size while joined,
    decoded and parsed: an agent's lever on a worker's memory, as large unary replies were.
    The bytes of an event are counted by chunk (a chunk that ends one event and starts the
    next counts for the first). Outside a ``large_body_scope`` the slot is released when the
    consumer asks for the next event; inside one, the scope keeps it until its block ends.
    """

    __slots__ = ("origin", "own", "size", "taken")

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.size = 0
        self.taken = False
        self.own: asyncio.Semaphore | None = None

    async def grew(self, count: int, clock: _Clock | None) -> None:
        self.size += count
        if self.taken or self.size <= LARGE_BODY_BYTES:
            return
        self.taken = True
        now = asyncio.get_running_loop().time
        started = now()
        self.own = await take_large_body_slot(self.origin)
        if clock is not None:
            clock.paused(now() - started)  # waiting for a slot is our time, not the agent's

    def ended(self) -> None:
        self.size, self.taken = 0, False
        if self.own is not None:
            self.own.release()
            self.own = None


async def _bounded_chunks(chunks: AsyncIterator[bytes], clock: _Clock) -> AsyncIterator[bytes]:
    """``chunks``, each awaited no later than the clock's next deadline."""
    it = aiter(chunks)
    while True:
        bound = clock.next_deadline()
        if bound is None:
            try:
                chunk = await anext(it)
            except StopAsyncIteration:
                return
        else:
            when, why = bound
            cm = asyncio.timeout_at(when)
            try:
                async with cm:
                    chunk = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                if cm.expired():
                    raise clock.error(why) from exc
                raise
        yield chunk


async def _iter_lines(
    chunks: AsyncIterator[bytes],
    max_line: int,
    where: str,
    clock: _Clock | None = None,
    large: _LargeEvent | None = None,
) -> AsyncIterator[bytes]:
    """Split a byte stream into SSE lines (CRLF, CR or LF), bounding line length.

    Only new bytes are scanned and a partial line is kept as a list of pieces,
    so a large event costs linear time. ``clock`` (if any) learns when a
    non-comment line starts; ``large`` (if any) counts each event's bytes.
    """
    if clock is not None and clock.active:
        chunks = _bounded_chunks(chunks, clock)
    else:
        clock = None
    try:
        async for line in _split_lines(chunks, max_line, where, clock, large):
            yield line
    finally:
        if large is not None:
            large.ended()


async def _split_lines(
    chunks: AsyncIterator[bytes],
    max_line: int,
    where: str,
    clock: _Clock | None,
    large: _LargeEvent | None,
) -> AsyncIterator[bytes]:
    partial: list[bytes] = []
    partial_len = 0
    cr_pending = False
    async for chunk in chunks:
        if large is not None:
            await large.grew(len(chunk), clock)
        if cr_pending:
            cr_pending = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        if clock is not None and not partial and chunk and chunk[0] not in _LINE_BREAK_BYTES:
            clock.line_started(chunk[0])
        pos = 0
        for m in _EOL.finditer(chunk):
            if m.group() == b"\r" and m.end() == len(chunk):
                cr_pending = True  # a "\n" may start the next chunk
            piece = chunk[pos : m.start()]
            if partial:
                partial.append(piece)
                line = b"".join(partial)
                partial, partial_len = [], 0
            else:
                line = piece
            t0 = clock.now() if clock is not None else 0.0
            yield line
            if not line and large is not None:
                large.ended()  # a blank line ends an event: the consumer is done with it
            if clock is not None:
                clock.paused(clock.now() - t0)
                # The next line's first byte is here already: after the
                # yield, since a blank line just yielded ends the event.
                if m.end() < len(chunk) and chunk[m.end()] not in _LINE_BREAK_BYTES:
                    clock.line_started(chunk[m.end()])
            pos = m.end()
        rest = chunk[pos:]
        if rest:
            partial.append(rest)
            partial_len += len(rest)
            if partial_len > max_line:
                raise PayloadTooLarge(
                    f"SSE line longer than the {max_line}-byte limit", where=where
                )
    if partial:
        yield b"".join(partial)
    yield b""  # a stream ending without the final blank line still dispatches


async def iter_sse(
    chunks: AsyncIterator[bytes],
    *,
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
    where: str = "",
    event_deadline: float | None = None,
    event_gap: float | None = None,
    origin: str | None = None,
) -> AsyncIterator[SSEMessage]:
    """Decode an SSE byte stream into events, bounding every event's size and time.

    ``event_deadline``: seconds an event may take from its first line to its
    end; ``event_gap``: seconds between complete events (keep-alives do not
    count). ``None`` disables either bound. ``origin``: the agent's, whose large-body
    slots an event past ``LARGE_BODY_BYTES`` takes (none: no slot is taken).
    """
    event = ""
    data: list[str] = []
    size = 0
    # Bytes since the last event dispatched, blank and comment lines included: a stream of
    # nothing but line breaks (or comments) made no event and cost a step per line without
    # end. Keep-alives are a few bytes every few seconds, far below the limit.
    idle_bytes = 0
    lines = 0
    clock = _Clock(event_deadline, event_gap, where)
    large = _LargeEvent(origin) if origin is not None else None
    async for raw in _iter_lines(chunks, max_event_bytes, where, clock, large):
        lines += 1
        if lines == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]  # a leading byte order mark is not part of the stream
        if lines % LINES_PER_TURN == 0:
            await asyncio.sleep(0)  # a chunk of many lines: let the loop's other tasks run
        if not raw:
            payload = "\n".join(data) if data else ""
            dispatched = bool(payload.strip())
            clock.event_done(dispatched=dispatched)
            if dispatched:
                idle_bytes = 0
                yield SSEMessage(event=event, data=payload)
            else:
                idle_bytes += size + 1  # the blank line, and the empty event it ended
                _bound_idle(idle_bytes, max_event_bytes, where)
            event, data, size = "", [], 0
            continue
        if raw.startswith(b":"):
            idle_bytes += len(raw) + 1
            _bound_idle(idle_bytes, max_event_bytes, where)
            continue  # comment / keep-alive
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError("SSE stream is not valid UTF-8", where=where) from exc
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name != "data":  # other fields count as idle (data lines count in ``size``)
            idle_bytes += len(raw) + 1
            _bound_idle(idle_bytes, max_event_bytes, where)
        if name == "data":
            size += len(raw) + 1
            if size > max_event_bytes:
                raise PayloadTooLarge(
                    f"SSE event larger than the {max_event_bytes}-byte limit", where=where
                )
            data.append(value)
        elif name == "event":
            event = value
        # id / retry have no meaning in A2A (§7); unknown fields are ignored.


def _bound_idle(idle_bytes: int, limit: int, where: str) -> None:
    if idle_bytes > limit:
        raise PayloadTooLarge(
            f"SSE stream sent more than {limit} bytes without an event", where=where
        )


async def iter_sse_response(
    response: httpx.Response,
    *,
    max_event_bytes: int,
    where: str,
    event_deadline: float | None = None,
    event_gap: float | None = None,
) -> AsyncIterator[SSEMessage]:
    async for msg in iter_sse(
        response.aiter_bytes(),
        max_event_bytes=max_event_bytes,
        where=where,
        event_deadline=event_deadline,
        event_gap=event_gap,
        origin=origin_of(response),
    ):
        yield msg


# --------------------------------------------------------------------------- payload checks


def _hint_03(value: str) -> str:
    return " (looks like A2A 0.3)" if value.islower() else ""


def _check_state(status: Any, where: str) -> None:
    if not isinstance(status, dict):
        raise ProtocolError(f"'status' must be an object, got {type(status).__name__}", where=where)
    state = status.get("state")
    if state is None:
        return  # default-valued (UNSPECIFIED); the fold reports it
    if not isinstance(state, str) or state not in ALL_STATES:
        hint = _hint_03(state) if isinstance(state, str) else ""
        raise ProtocolError(f"unknown task state {state!r}{hint}", where=f"{where}.state")
    if "message" in status and status["message"] is not None:
        _check_message(status["message"], f"{where}.message")


def _check_parts(parts: Any, where: str) -> None:
    if parts is None:
        return
    if not isinstance(parts, list):
        raise ProtocolError("'parts' must be an array", where=where)
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ProtocolError("part must be an object", where=f"{where}[{i}]")


def _require_id(obj: dict[str, Any], key: str, where: str) -> None:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"missing or empty '{key}'", where=where)


def _check_message(msg: Any, where: str) -> None:
    if not isinstance(msg, dict):
        raise ProtocolError("message must be an object", where=where)
    _require_id(msg, "messageId", where)
    role = msg.get("role")
    if role is not None and role not in ALL_ROLES:
        hint = _hint_03(role) if isinstance(role, str) else ""
        raise ProtocolError(f"unknown role {role!r}{hint}", where=f"{where}.role")
    _check_parts(msg.get("parts"), f"{where}.parts")


def _check_artifact(art: Any, where: str) -> None:
    if not isinstance(art, dict):
        raise ProtocolError("artifact must be an object", where=where)
    _require_id(art, "artifactId", where)
    _check_parts(art.get("parts"), f"{where}.parts")


def check_task(task: Any, where: str = "task") -> dict[str, Any]:
    """Validate the shape of a Task object (ids, known enums, no 0.3 ``kind``)."""
    if not isinstance(task, dict):
        raise ProtocolError(f"expected a Task object, got {type(task).__name__}", where=where)
    _require_id(task, "id", where)
    if "status" not in task:
        raise ProtocolError("task without 'status'", where=where)
    _check_state(task["status"], f"{where}.status")
    arts = task.get("artifacts")
    if arts is not None:
        if not isinstance(arts, list):
            raise ProtocolError("'artifacts' must be an array", where=where)
        for i, art in enumerate(arts):
            _check_artifact(art, f"{where}.artifacts[{i}]")
    hist = task.get("history")
    if hist is not None:
        if not isinstance(hist, list):
            raise ProtocolError("'history' must be an array", where=where)
        for i, msg in enumerate(hist):
            _check_message(msg, f"{where}.history[{i}]")
    return task


def _check_member(kind: str, member: Any, where: str) -> None:
    if not isinstance(member, dict):
        raise ProtocolError(f"'{kind}' must be an object", where=where)
    if kind == "task":
        check_task(member, where)
    elif kind == "message":
        _check_message(member, where)
    elif kind == "statusUpdate":
        _require_id(member, "taskId", where)
        if "status" not in member:
            raise ProtocolError("status update without 'status'", where=where)
        _check_state(member["status"], f"{where}.status")
    elif kind == "artifactUpdate":
        _require_id(member, "taskId", where)
        if "artifact" not in member:
            raise ProtocolError("artifact update without 'artifact'", where=where)
        _check_artifact(member["artifact"], f"{where}.artifact")


def parse_stream_response(
    obj: Any, *, where: str = "", allowed: Iterable[str] = EVENT_KINDS
) -> StreamEvent:
    """Turn one StreamResponse JSON object into a :class:`StreamEvent`."""
    if not isinstance(obj, dict):
        raise ProtocolError(
            f"expected a StreamResponse object, got {type(obj).__name__}", where=where
        )
    # ProtoJSON: a member that is null is not set (its default).
    present = [k for k in EVENT_KINDS if obj.get(k) is not None]
    if not present and "kind" in obj:
        raise ProtocolError(
            f"payload has 'kind'={obj.get('kind')!r}: a 0.3-shaped payload on a 1.0 interface",
            where=where,
        )
    if not present:
        keys = ", ".join(sorted(obj)[:8]) or "none"
        raise ProtocolError(
            f"no task/message/statusUpdate/artifactUpdate member (keys: {keys})", where=where
        )
    if len(present) > 1:
        raise ProtocolError(f"more than one StreamResponse member: {present}", where=where)
    kind = present[0]
    allowed = tuple(allowed)
    if kind not in allowed:
        raise ProtocolError(f"unexpected '{kind}' (expected one of {list(allowed)})", where=where)
    _check_member(kind, obj[kind], f"{where}.{kind}" if where else kind)
    return StreamEvent(kind=kind, payload=obj[kind], raw=obj)  # type: ignore[arg-type]
