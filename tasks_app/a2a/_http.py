"""Low-level HTTP helpers: bounded reads, JSON decoding, httpx error mapping.

Every network failure leaves this module as a :class:`TransportError`
subclass and every unreadable body as a :class:`ProtocolError`, so the rest of
the package never has to catch httpx exceptions itself.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import httpx

from .errors import (
    A2AError,
    ConnectError,
    ConnectionDropped,
    DeadlineExceeded,
    OutboundRefused,
    PayloadTooLarge,
    ProtocolError,
    RequestTimeout,
    StreamIdleTimeout,
    TransportError,
    from_http_error,
)
from .guard import refusal_in
from .safejson import loads, whole_number

JSON_MEDIA_TYPES = ("application/json", "application/a2a+json", "application/problem+json")
SSE_MEDIA_TYPE = "text/event-stream"


def media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").partition(";")[0].strip().lower()


def is_json_media(mt: str) -> bool:
    return mt in JSON_MEDIA_TYPES or mt.endswith("+json")


# What httpx raises for a request it could not make or finish. ``InvalidURL`` is not an
# ``HTTPError``: a host that does not encode as IDNA (a right-to-left override in a URL an
# operator typed, or a card's interface URL) escaped as a 500 from the card preview.
HTTPX_ERRORS = (httpx.HTTPError, httpx.InvalidURL)


def map_transport_error(
    exc: httpx.HTTPError | httpx.InvalidURL, where: str, *, streaming: bool = False
) -> A2AError:
    """Translate an httpx exception into our hierarchy (keeps it as ``__cause__``)."""
    refusal = refusal_in(exc)
    if refusal is not None:  # never connected: the reason is all there is to say
        shown = where if len(where) <= 120 else where[:119] + "…"  # keep the reason in view
        return OutboundRefused(f"{shown}: {refusal}")
    detail = str(exc) or exc.__class__.__name__
    if isinstance(exc, httpx.ConnectTimeout):
        return ConnectError(f"{where}: connect timeout ({detail})")
    if isinstance(exc, httpx.ConnectError):
        return ConnectError(f"{where}: cannot connect ({detail})")
    if isinstance(exc, httpx.ReadTimeout):
        if streaming:
            return StreamIdleTimeout(
                f"{where}: stream silent for too long (no event or keep-alive)"
            )
        return RequestTimeout(f"{where}: no answer in time")
    if isinstance(exc, httpx.TimeoutException):
        return RequestTimeout(f"{where}: timed out ({exc.__class__.__name__})")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return ConnectionDropped(f"{where}: connection dropped ({detail})")
    if isinstance(exc, httpx.LocalProtocolError):
        # Never its text: it quotes the header it refused, and that can be a credential.
        return TransportError(
            f"{where}: the request could not be written (a header value, such as a "
            "credential, holds characters HTTP does not allow)"
        )
    if isinstance(exc, httpx.DecodingError):  # the agent's body could not be taken as sent
        return ProtocolError(f"{where}: {detail}")
    if isinstance(exc, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return TransportError(f"{where}: bad URL ({detail})")
    return TransportError(f"{where}: {detail}")


def deadline_error(where: str, seconds: float, what: str = "") -> DeadlineExceeded:
    tail = f" ({what})" if what else ""
    return DeadlineExceeded(f"{where}: no complete response after {seconds:g} s{tail}")


@asynccontextmanager
async def deadline(seconds: float | None, where: str) -> AsyncIterator[None]:
    """Bound a whole exchange (connect, headers, body) in wall-clock time.

    httpx's timeouts are per operation: a body trickling a byte a second
    never trips them. ``None`` means no bound. Do not ``yield`` to another
    task from inside (an async generator's ``yield``): the cancellation would
    land in the consumer.
    """
    if seconds is None:
        yield
        return
    cm = asyncio.timeout(seconds)
    try:
        async with cm:
            yield
    except TimeoutError as exc:
        if cm.expired():
            raise deadline_error(where, seconds) from exc
        raise


# Large bodies -----------------------------------------------------------------------------
#
# A reply of up to 32 MiB (a task holding a large artifact, on every GetTask) costs about
# three times its size while it is read, joined, decoded and parsed, and the parsed value
# lives on until it is recorded. Any number of them read at once on one event loop (a
# worker's streams and polls share one) made an agent with many such tasks a lever on the
# worker's memory. So a body past ``LARGE_BODY_BYTES`` takes one of ``LARGE_BODIES_AT_ONCE``
# slots of its origin (the agent's scheme, host and port) on its loop before more of it is
# read (the rest waits in the socket), and keeps it until the read returns, or, inside
# ``large_body_scope()``, until that block ends (a caller that parses and records what it
# read). Per origin: an agent that trickles its large replies holds only its own slots, never
# another agent's. Smaller bodies never wait.

LARGE_BODY_BYTES = 1024 * 1024
LARGE_BODIES_AT_ONCE = 2

_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = (
    weakref.WeakKeyDictionary()
)


class LargeBodyScope:
    """One ``large_body_scope`` block: its task, and the slot a read in it took (if any)."""

    __slots__ = ("gate", "task")

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        self.task = task
        self.gate: asyncio.Semaphore | None = None

    @property
    def holding(self) -> bool:
        """Whether a read in this block took a slot (kept until the block ends)."""
        return self.gate is not None


_scope: ContextVar[LargeBodyScope | None] = ContextVar("a2a_large_body_scope", default=None)


def _origin_gate(origin: str) -> asyncio.Semaphore:
    gates = _gates.setdefault(asyncio.get_running_loop(), {})
    gate = gates.get(origin)
    if gate is None:
        gate = gates[origin] = asyncio.Semaphore(LARGE_BODIES_AT_ONCE)
    return gate


@asynccontextmanager
async def large_body_scope() -> AsyncIterator[LargeBodyScope]:
    """Keep the slot a large body read in this block takes until the block ends.

    Around everything that holds what was read (its parse, its recording). A scope inside
    another of the same task is the outer one; tasks started inside (``gather``) have
    their own reads, not this scope's slot. An SSE event counts as a body: one read past
    ``LARGE_BODY_BYTES`` in the block (the next event of a stream) takes a slot too.
    """
    outer = _scope.get()
    task = asyncio.current_task()
    if outer is not None and outer.task is task:
        yield outer
        return
    scope = LargeBodyScope(task)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)
        if scope.gate is not None:
            scope.gate.release()


async def take_large_body_slot(origin: str) -> asyncio.Semaphore | None:
    """Wait for a slot of ``origin`` on this loop. Returns the gate the caller must release
    itself (None: the enclosing scope keeps it, or kept one already)."""
    scope = _scope.get()
    if scope is not None and scope.task is not asyncio.current_task():
        scope = None  # another task's scope (a context copied by create_task)
    if scope is not None and scope.gate is not None:
        return None
    gate = _origin_gate(origin)
    await gate.acquire()
    if scope is not None:
        scope.gate = gate
        return None
    return gate


def origin_of(response: httpx.Response) -> str:
    url = response.request.url
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}"


async def read_bounded(response: httpx.Response, limit: int, where: str) -> bytes:
    """Read a streamed response body, refusing more than ``limit`` bytes.

    Past ``LARGE_BODY_BYTES`` (declared, or read so far) the read waits for a large
    body's slot (see above).
    """
    declared = whole_number(response.headers.get("content-length") or "")
    if declared is not None and declared > limit:
        raise PayloadTooLarge(
            f"response of {declared} bytes exceeds the {limit}-byte limit", where=where
        )
    chunks: list[bytes] = []
    size = 0
    large = False
    own: asyncio.Semaphore | None = None  # a slot taken outside any scope: released here
    try:
        if declared is not None and declared > LARGE_BODY_BYTES:
            large, own = True, await take_large_body_slot(origin_of(response))
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"response exceeds the {limit}-byte limit", where=where)
            chunks.append(chunk)
            if size > LARGE_BODY_BYTES and not large:
                large, own = True, await take_large_body_slot(origin_of(response))
        return b"".join(chunks)
    finally:
        if own is not None:
            own.release()


SNIPPET_CHARS = 80


def snippet_of(body: bytes | str, limit: int = SNIPPET_CHARS) -> str:
    """The start of a body, for an error message: one line, printable characters only.

    Short on purpose: a message is shown to people and stored; the body is someone
    else's (control and bidi characters could disguise what the message says).
    """
    text = (
        body[: limit * 8 + 256].decode("utf-8", "replace")
        if isinstance(body, bytes)
        else body[: limit * 8 + 256]
    )
    text = "".join(ch for ch in text if ch.isprintable() or ch.isspace())
    return " ".join(text.split())[:limit]


def decode_json(body: bytes, where: str, *, mt: str = "") -> Any:
    """Parse a JSON body; anything else is a ProtocolError saying what came instead.

    Nesting deeper than :data:`safejson.DEFAULT_MAX_DEPTH` is refused with a
    ProtocolError saying so (never a ``RecursionError``).
    """
    try:
        return loads(body)
    except ProtocolError as exc:
        if not isinstance(exc.__cause__, ValueError):
            exc.where = exc.where or where
            raise  # too deep: its own message says where
        # A body labelled JSON that does not parse was said to be "expected JSON, got
        # application/json": the label is not what failed.
        what = f"{mt or 'no content type'}"
        said = (
            f"the body is not valid JSON ({what})"
            if "json" in what.lower()
            else f"expected JSON, got {what}"
        )
        raise ProtocolError(
            f"{said}: {snippet_of(body) or '(empty body)'}",
            where=where,
            snippet=snippet_of(body, 500),
        ) from exc.__cause__


def error_for_status(response: httpx.Response, body: bytes, where: str) -> A2AError:
    """Typed error for a non-2xx response (A2A error body when there is one)."""
    mt = media_type(response)
    parsed: Any = None
    if body:
        try:
            parsed = loads(body)
        except ProtocolError:
            parsed = None  # unreadable or too deep: reported as a non-A2A body
    err = from_http_error(
        response.status_code, parsed, text=snippet_of(body, 500) if parsed is None else ""
    )
    if isinstance(err, ProtocolError) and not err.where:
        err.where = where
    if parsed is None and mt and not is_json_media(mt) and isinstance(err, ProtocolError):
        err.message = f"{err.message} (content type {mt})"
    return err
