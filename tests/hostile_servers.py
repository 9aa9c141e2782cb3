"""Raw HTTP/1.1 servers on 127.0.0.1 that attack the protocol client on purpose.

No framework: a framework would refuse to send what these send (a body that
trickles forever, lone surrogates, 10,000 nested arrays). One server serves
every behaviour, chosen by the first path segment; the rest of the path says
the binding: ``POST /<mode>`` is the JSON-RPC endpoint, anything below
``/<mode>/`` is HTTP+JSON (REST), ``/<mode>/.well-known/agent-card.json`` the
card. Replies to JSON-RPC echo the request ``id``.

Modes:

``trickle``       200 JSON, a valid reply preceded by whitespace, one byte per
                  ``interval`` (never finishes in a test's lifetime)
``keepalive``     SSE headers, then ``: ping`` comment lines one byte at a time, forever
``blanklines``    SSE headers, then ``\\n`` one byte at a time, forever
``slowevent``     SSE: one valid Task event, then an event whose data line
                  trickles whitespace forever
``deep``          a reply whose result nests ``depth`` arrays
``deepsse``       SSE: one event whose data nests ``depth`` arrays
``badtext``       a Task whose text holds a lone surrogate, NUL, and a NaN score
``jscard``        a card whose only interface URL is ``javascript:``
``mixedcard``     a card: a ``file:`` interface first, then a valid http one
``big``           a Task whose one artifact holds ``big_bytes`` of text (a GetTask reply
                  of a task with a large artifact)
``bigsse``        SSE: the Task, then ``bigsse_events`` artifact chunks of ``big_bytes`` of text
                  each (``big-0``, ``big-1``, ...), then a completed status
``steady``        GetTask (JSON-RPC): the newest ``historyLength`` messages of ``steady_history``
                  (a list the test grows; at most ``steady_cap`` when set), all of it when no
                  length is asked
``newids``        GetTask (JSON-RPC): a history of fresh message ids each time, exactly as
                  long as asked (``NEWIDS_WHOLE`` when no length is asked)

Every connection is recorded (:class:`Conn`): request line, body bytes sent,
whether and when the peer hung up, so tests can assert the bound at which the
client gave up, not only the error it raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from functools import cache
from typing import Any

TASK_ID = "hostile-task-1"
DEEP_DEPTH = 10_000
NEWIDS_WHOLE = 3_000


@cache
def _gzipped_filler(filler: bytes) -> tuple[bytes, Any]:
    """64 MB of ``filler`` gzipped (64 KB), and the compressor's state after it: made once a
    process, since the compression alone took about 0.3 s of CPU for each reply."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return packer.compress(filler * (64 * 1024 * 1024)), packer


def gzip_bomb(filler: bytes, tail: bytes) -> bytes:
    """64 MB of ``filler``, then ``tail``, as one gzip member."""
    head, packer = _gzipped_filler(filler)
    packer = packer.copy()  # the cached state stays where the filler ended
    return head + packer.compress(tail) + packer.flush()


def task_json(task_id: str = TASK_ID, state: str = "TASK_STATE_WORKING") -> dict[str, Any]:
    return {"id": task_id, "contextId": "ctx-hostile", "status": {"state": state}}


@dataclass
class Conn:
    """What one connection asked for and what it was sent."""

    method: str = ""
    path: str = ""
    accept_encoding: str | None = None  # the request's Accept-Encoding header, if any
    body_bytes_sent: int = 0
    body_sent: bytearray = field(default_factory=bytearray)  # first 256 KB only
    peer_closed_at: float | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def peer_closed(self) -> bool:
        return self.peer_closed_at is not None


class PeerGone(Exception):
    """The client hung up while we were still sending."""


class HostileServer:
    """The server, on its own event loop in a daemon thread (it outlives test loops)."""

    def __init__(
        self, *, interval: float = 0.25, trickle_bytes: int = 160, big_bytes: int = 8 << 20
    ) -> None:
        self.interval = interval  # seconds between trickled bytes
        self.big_bytes = big_bytes  # the text of the ``big`` mode's artifact
        self.bigsse_events = 3  # the ``bigsse`` mode's large events
        self.steady_history: list[dict[str, Any]] = []  # the ``steady`` mode's conversation
        # A lower limit of the agent's own on a windowed GetTask (the spec allows one).
        self.steady_cap: int | None = None
        self.trickle_bytes = trickle_bytes  # whitespace before a trickled reply
        self.port = 0
        self.conns: list[Conn] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> HostileServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        async def _close() -> None:
            for w in list(self._writers):
                w.transport.abort()
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._loop.close()

    def url_for(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"

    def conns_for(self, mode: str) -> list[Conn]:
        with self._lock:
            return [c for c in self.conns if c.path.split("/")[1:2] == [mode]]

    def wait_peer_closed(self, conn: Conn, timeout: float = 10.0) -> bool:
        """Wait (a deadline, not a measurement) until the server saw ``conn``'s client hang up."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if conn.peer_closed:
                return True
            time.sleep(0.05)
        return conn.peer_closed

    # ------------------------------------------------------------------ plumbing

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        conn = Conn()
        with self._lock:
            self.conns.append(conn)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            conn.method, target, _ = [*lines[0].split(" "), "", ""][:3]
            conn.path = target.split("?", 1)[0]
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            conn.accept_encoding = headers.get("accept-encoding")
            length = int(headers.get("content-length") or 0)
            body = await reader.readexactly(length) if length else b""
            await self._route(conn, body, reader, writer)
        except (PeerGone, ConnectionError, asyncio.IncompleteReadError):
            if conn.peer_closed_at is None:
                conn.peer_closed_at = time.monotonic()
        finally:
            if conn.peer_closed_at is None and reader.at_eof():
                conn.peer_closed_at = time.monotonic()
            self._writers.discard(writer)
            writer.transport.abort()

    @staticmethod
    def _head(status: str, content_type: str, length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {status}", f"Content-Type: {content_type}", "Connection: close"]
        if length is not None:
            lines.append(f"Content-Length: {length}")
        else:
            lines.append("Cache-Control: no-cache")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def _send(self, conn: Conn, writer: asyncio.StreamWriter, data: bytes) -> None:
        # Counted before the write: the client (another thread) may read the bytes, fail and
        # have the test look at what was sent before this coroutine runs again after drain().
        conn.body_bytes_sent += len(data)
        if len(conn.body_sent) < 256 * 1024:
            conn.body_sent += data[: 256 * 1024 - len(conn.body_sent)]
        writer.write(data)
        await writer.drain()

    async def _trickle(
        self, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
    ) -> None:
        """Send ``data`` one byte per interval; stop as soon as the client hangs up."""
        for i in range(len(data)):
            if reader.at_eof() or writer.is_closing():
                conn.peer_closed_at = time.monotonic()
                raise PeerGone
            await self._send(conn, writer, data[i : i + 1])
            await asyncio.sleep(self.interval)

    async def _forever(
        self, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, unit: bytes
    ) -> None:
        while True:
            await self._trickle(conn, reader, writer, unit)

    # ------------------------------------------------------------------ behaviours

    async def _route(
        self,
        conn: Conn,
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        parts = conn.path.split("/")
        mode = parts[1] if len(parts) > 1 else ""
        rest = "/".join(parts[2:])
        jsonrpc = conn.method == "POST" and rest == ""
        rid: Any = None
        if jsonrpc:
            with contextlib.suppress(ValueError, AttributeError):
                rid = json.loads(body).get("id")

        def reply_text(result_text: str) -> bytes:
            """The reply body around an already-serialised result."""
            if jsonrpc:
                return (
                    f'{{"jsonrpc":"2.0","id":{json.dumps(rid)},"result":{result_text}}}'
                ).encode()
            return result_text.encode()

        def event_text(result_text: str) -> bytes:
            return b"data: " + reply_text(result_text) + b"\n\n"

        sse_head = self._head("200 OK", "text/event-stream", None)

        if rest == ".well-known/agent-card.json":
            await self._card(conn, mode, reader, writer)
        elif mode == "trickle":
            payload = b" " * self.trickle_bytes + reply_text(json.dumps(task_json()))
            writer.write(self._head("200 OK", "application/json", len(payload)))
            await self._trickle(conn, reader, writer, payload)
        elif mode == "keepalive":
            writer.write(sse_head)
            await self._forever(conn, reader, writer, b": ping\n")
        elif mode == "blanklines":
            writer.write(sse_head)
            await self._forever(conn, reader, writer, b"\n")
        elif mode in ("gzip", "gzipsse"):
            # Compressed whatever was asked: 64 KB of gzip that would decode to 64 MB of line
            # breaks (a stream of empty events) or of spaces before a JSON reply.
            filler = b"\n" if mode == "gzipsse" else b" "
            payload = gzip_bomb(filler, reply_text(json.dumps(task_json())))
            content_type = "text/event-stream" if mode == "gzipsse" else "application/json"
            head = self._head("200 OK", content_type, len(payload))
            writer.write(head.replace(b"\r\n\r\n", b"\r\nContent-Encoding: gzip\r\n\r\n", 1))
            await self._send(conn, writer, payload)
        elif mode == "slowevent":
            writer.write(sse_head)
            await self._send(conn, writer, event_text(json.dumps({"task": task_json()})))
            await self._send(conn, writer, b"data: {")
            await self._forever(conn, reader, writer, b" ")
        elif mode == "deep":
            payload = reply_text("[" * DEEP_DEPTH + "]" * DEEP_DEPTH)
            writer.write(self._head("200 OK", "application/json", len(payload)))
            await self._send(conn, writer, payload)
        elif mode == "deepsse":
            writer.write(sse_head)
            await self._send(conn, writer, event_text("[" * DEEP_DEPTH + "]" * DEEP_DEPTH))
        elif mode == "badtext":
            task = task_json()
            task["status"]["message"] = {
                "messageId": "m-bad",
                "role": "ROLE_AGENT",
                "parts": [{"text": "@@LONE@@ and @@NUL@@"}],
            }
            task["metadata"] = {"score": "@@NAN@@"}
            text = (
                json.dumps(task)
                .replace("@@LONE@@", "\\ud800")
                .replace("@@NUL@@", "\\u0000")
                .replace('"@@NAN@@"', "NaN")
            )
            payload = reply_text(text)
            writer.write(self._head("200 OK", "application/json", len(payload)))
            await self._send(conn, writer, payload)
        elif mode == "big":
            # drain() waits for an empty buffer: the connection is aborted once this returns,
            # which dropped the end of a body still buffered.
            writer.transport.set_write_buffer_limits(high=0)
            task = task_json()
            task["artifacts"] = [{"artifactId": "big", "parts": [{"text": "@@BIG@@"}]}]
            head, tail = reply_text(json.dumps(task)).split(b"@@BIG@@")
            writer.write(
                self._head("200 OK", "application/json", len(head) + self.big_bytes + len(tail))
            )
            await self._send(conn, writer, head)
            for _ in range(self.big_bytes // (1 << 20)):
                await self._send(conn, writer, b"x" * (1 << 20))
            await self._send(conn, writer, b"x" * (self.big_bytes % (1 << 20)) + tail)
        elif mode == "bigsse":
            writer.transport.set_write_buffer_limits(high=0)  # as ``big``: flushed before the end
            writer.write(sse_head)
            await self._send(conn, writer, event_text(json.dumps({"task": task_json()})))
            for i in range(self.bigsse_events):
                chunk = {
                    "taskId": TASK_ID, "contextId": "ctx-hostile", "append": i > 0,
                    "artifact": {"artifactId": "big", "parts": [{"text": f"big-{i}@@BIG@@"}]},
                }  # fmt: skip
                head, tail = event_text(json.dumps({"artifactUpdate": chunk})).split(b"@@BIG@@")
                await self._send(conn, writer, head)
                for _ in range(self.big_bytes // (1 << 20)):
                    await self._send(conn, writer, b"x" * (1 << 20))
                await self._send(conn, writer, b"x" * (self.big_bytes % (1 << 20)) + tail)
            done = task_json(state="TASK_STATE_COMPLETED")
            update = {"taskId": TASK_ID, "contextId": "ctx-hostile", "status": done["status"]}
            await self._send(conn, writer, event_text(json.dumps({"statusUpdate": update})))
        elif mode == "steady":
            asked = None
            with contextlib.suppress(ValueError, AttributeError):
                asked = json.loads(body).get("params", {}).get("historyLength")
            task = task_json()
            history = list(self.steady_history)
            if isinstance(asked, int) and asked > 0:
                history = history[-min(asked, self.steady_cap or asked) :]
            task["history"] = history
            payload = reply_text(json.dumps(task))
            writer.write(self._head("200 OK", "application/json", len(payload)))
            await self._send(conn, writer, payload)
        elif mode == "newids":
            # No window ever reaches back to a message the client holds.
            asked = None
            with contextlib.suppress(ValueError, AttributeError):
                asked = json.loads(body).get("params", {}).get("historyLength")
            count = asked if isinstance(asked, int) and asked > 0 else NEWIDS_WHOLE
            task = task_json()
            task["history"] = [
                {"messageId": uuid.uuid4().hex, "role": "ROLE_AGENT", "parts": [{"text": "x"}]}
                for _ in range(count)
            ]
            payload = reply_text(json.dumps(task))
            writer.write(self._head("200 OK", "application/json", len(payload)))
            await self._send(conn, writer, payload)
        else:
            payload = b'{"error": "unknown mode"}'
            writer.write(self._head("404 Not Found", "application/json", len(payload)))
            await self._send(conn, writer, payload)

    async def _card(
        self, conn: Conn, mode: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        base = self.url_for(mode)
        if mode == "jscard":
            ifaces = [
                {
                    "url": "javascript:alert(1)",
                    "protocolBinding": "JSONRPC",
                    "protocolVersion": "1.0",
                }
            ]
        elif mode == "mixedcard":
            ifaces = [
                {
                    "url": "file:///etc/passwd",
                    "protocolBinding": "JSONRPC",
                    "protocolVersion": "1.0",
                },
                {"url": base, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"},
            ]
        else:
            ifaces = [{"url": base, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}]
        card = {
            "name": f"Hostile {mode}",
            "description": "misbehaves on purpose",
            "version": "1.0.0",
            "supportedInterfaces": ifaces,
            "capabilities": {"streaming": True},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [{"id": "s", "name": "s", "description": "s", "tags": ["t"]}],
        }
        payload = json.dumps(card).encode()
        if mode == "trickle":
            payload = b" " * self.trickle_bytes + payload
            writer.write(self._head("200 OK", "application/json", len(payload)))
            await self._trickle(conn, reader, writer, payload)
            return
        writer.write(self._head("200 OK", "application/json", len(payload)))
        await self._send(conn, writer, payload)
