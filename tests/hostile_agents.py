"""Misbehaving A2A agents for the watcher tests: a raw JSON-RPC server on 127.0.0.1.

:class:`HostileAgent` speaks just enough A2A 1.0 over JSON-RPC (SendMessage,
SendStreamingMessage, GetTask, SubscribeToTask, ListTasks, CancelTask) to be
followed by the dashboard, and misbehaves as its ``behaviour`` says. It keeps
its own tasks, and counts every request by method (``calls``), so a test can
assert how hard the dashboard hit it.

Behaviours:

``wrongid``      GetTask answers a task with another id; SubscribeToTask sends
                 the right snapshot, then closes cleanly (the task goes on)
``unspecified``  GetTask answers the task in ``TASK_STATE_UNSPECIFIED``
``quietclose``   a well-formed agent whose streams close at once on a task that
                 goes on (every GetTask confirms it is still working)
``flood``        the send stream carries ``flood_events`` distinct status
                 updates as fast as it can, then closes
``lostreply``    SendMessage creates the task (completed, with an artifact),
                 then drops the connection before any reply byte
``forget``       after the first ``forget_after`` GetTask calls, answers
                 TaskNotFound (the agent restarted without its tasks)
``authwait``     tasks wait in AUTH_REQUIRED until a follow-up message on them
                 arrives; then they complete (``answered`` records when)
``refuseonce``   as ``authwait``, but the first follow-up message on a task is refused
                 (a JSON-RPC error); the next one is taken
``garbage``      GetTask answers a body that is not JSON
``trickle``      every answer about a task (SendMessage, GetTask, and the events of
                 SendStreamingMessage and SubscribeToTask) trickles whitespace,
                 one byte per ``trickle_interval``, and never completes; the task
                 is created all the same. ListTasks answers at once
``keepalive``    SendStreamingMessage sends the task, then nothing but keep-alive
                 comments, forever; SubscribeToTask sends only keep-alives, forever
``deep``         every answer about a task (replies and stream events) is a result
                 nested ``DEEP_DEPTH`` arrays deep; the task is created all the
                 same. ListTasks answers at once
``badtext``      tasks complete at once; their status message, artifact name and
                 text, and metadata hold lone surrogates, NUL, markup and an RTL
                 override (``BAD_TEXT``), sent as JSON escapes
``cutafterword`` every stream (the send's and each SubscribeToTask) brings one new status
                 (the task, with a later status timestamp), then half an event, and the
                 connection is cut; GetTask answers the task as it is
``errorafterword`` each SubscribeToTask sends the task as it is, then an ``error`` event
                 (a JSON-RPC error); GetTask answers the task as it is
``nosubscribe``  SubscribeToTask is refused as unsupported; GetTask answers the task
``huge``         SendStreamingMessage streams one artifact of ``huge_chunks``
                 chunks of ``huge_chunk_chars`` characters (appended, with flow
                 control), then completes; GetTask answers the whole task

Use it as a context manager, or through the ``hostile`` fixture factory.
Besides ``calls`` it counts what the dashboard cost it: ``open_now`` and
``open_max`` (connections held open at once) and ``bytes_sent``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.agents import _LoopThread

WORKING = "TASK_STATE_WORKING"
COMPLETED = "TASK_STATE_COMPLETED"
AUTH_REQUIRED = "TASK_STATE_AUTH_REQUIRED"
CANCELED = "TASK_STATE_CANCELED"
DEEP_DEPTH = 10_000
# Text no database stores as is (a lone surrogate; NUL, which jsonb refuses), plus markup and an
# RTL override that a page must show escaped. The ``@`` marks let a test find each piece.
BAD_TEXT = "@lone\ud800@nul\x00@<script>alert(1)</script>@\u202eevil@"


class HostileAgent:
    """A tiny HTTP/1.1 JSON-RPC A2A agent that misbehaves on purpose (see the module docstring)."""

    def __init__(
        self,
        behaviour: str,
        *,
        flood_events: int = 3000,
        forget_after: int = 1,
        trickle_interval: float = 1.0,
        keepalive_interval: float = 0.2,
        huge_chunks: int = 30,
        huge_chunk_chars: int = 1_000_000,
    ) -> None:
        self.behaviour = behaviour
        self.flood_events = flood_events
        self.forget_after = forget_after
        self.trickle_interval = trickle_interval
        self.keepalive_interval = keepalive_interval
        self.huge_chunks = huge_chunks
        self.huge_chunk_chars = huge_chunk_chars
        self.open_now = 0
        self.open_max = 0
        self.bytes_sent = 0
        self.tasks: dict[str, dict] = {}
        self.calls: Counter[str] = Counter()
        self.call_times: list[tuple[float, str]] = []
        self.answered: dict[str, float] = {}
        self.refused: set[str] = set()  # tasks whose first follow-up was refused (refuseonce)
        self.port = 0
        self._lt: _LoopThread | None = None
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/rpc"

    def start(self) -> HostileAgent:
        self._lt = _LoopThread(f"hostile-{self.behaviour}")

        async def _start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._lt.call(_start())
        return self

    def close(self) -> None:
        if self._lt is None:
            return

        async def _close() -> None:
            if self._server is not None:
                self._server.close()

        with contextlib.suppress(Exception):
            self._lt.call(_close())
        self._lt.stop()
        self._lt = None

    def __enter__(self) -> HostileAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def calls_since(self, since: float, method: str | None = None) -> int:
        return sum(
            1 for t, m in list(self.call_times) if t >= since and (method is None or m == method)
        )

    # -- HTTP
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_now += 1
        self.open_max = max(self.open_max, self.open_now)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            headers = {}
            for line in head.decode("latin-1").split("\r\n")[1:]:
                if ":" in line:
                    key, value = line.split(":", 1)
                    headers[key.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            request = json.loads(body) if body else {}
            await self._respond(request, reader, writer)
            await writer.drain()
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            asyncio.CancelledError,
            ValueError,
            PeerGone,
        ):
            pass
        finally:
            self.open_now -= 1
            with contextlib.suppress(Exception):
                writer.close()

    @staticmethod
    def _json(writer: asyncio.StreamWriter, obj: Any) -> None:
        body = json.dumps(obj).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

    @staticmethod
    def _sse(writer: asyncio.StreamWriter, rpc_id: Any, results: list[Any]) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
            b"Connection: close\r\n\r\n"
        )
        for result in results:
            data = json.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": result})
            writer.write(f"data: {data}\n\n".encode())

    async def _write(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes
    ) -> None:
        """Send ``data`` and wait for the peer to take it (flow control); stop if it hung up."""
        if reader.at_eof() or writer.is_closing():
            raise PeerGone
        writer.write(data)
        await writer.drain()
        self.bytes_sent += len(data)

    async def _forever(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        unit: bytes,
        interval: float,
    ) -> None:
        """Send ``unit`` every ``interval`` seconds until the peer hangs up (or the agent closes)."""
        while True:
            await self._write(reader, writer, unit)
            await asyncio.sleep(interval)

    @staticmethod
    def _sse_head(writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
            b"Connection: close\r\n\r\n"
        )

    @staticmethod
    def _deep_json(rpc_id: Any) -> bytes:
        nested = "[" * DEEP_DEPTH + "]" * DEEP_DEPTH
        return f'{{"jsonrpc":"2.0","id":{json.dumps(rpc_id)},"result":{nested}}}'.encode()

    async def _misbehave(
        self,
        method: str,
        rpc_id: Any,
        task: dict,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer ``method`` about ``task`` as the behaviour says; False: answer it normally."""
        b = self.behaviour
        streaming = method in ("SendStreamingMessage", "SubscribeToTask")
        if b == "trickle":
            if streaming:
                self._sse_head(writer)
                await self._write(reader, writer, b"data: ")  # an event starts, and never ends
            else:
                body = json.dumps(
                    {"jsonrpc": "2.0", "id": rpc_id, "result": {"task": task}}
                ).encode()
                padding = 100_000  # a day of whitespace at a byte a second, before the reply
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {padding + len(body)}\r\n\r\n".encode()
                )
            await self._forever(reader, writer, b" ", self.trickle_interval)
            return True
        if b == "deep":
            if streaming:
                self._sse_head(writer)
                await self._write(reader, writer, b"data: " + self._deep_json(rpc_id) + b"\n\n")
            else:
                body = self._deep_json(rpc_id)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                )
                await self._write(reader, writer, body)
            return True
        if b == "keepalive" and streaming:
            self._sse_head(writer)
            if method == "SendStreamingMessage":
                event = json.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": {"task": task}})
                await self._write(reader, writer, f"data: {event}\n\n".encode())
            await self._forever(reader, writer, b": keep-alive\n\n", self.keepalive_interval)
            return True
        if b == "cutafterword" and streaming:
            task["status"] = {
                "state": WORKING,
                "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            }
            self._sse_head(writer)
            event = json.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": {"task": task}})
            await self._write(reader, writer, f"data: {event}\n\n".encode())
            await self._write(reader, writer, b'data: {"jsonrpc": "2.0", "res')
            writer.transport.abort()
            return True
        if b == "errorafterword" and method == "SubscribeToTask":
            failure = {"code": -32603, "message": "internal error after the snapshot"}
            self._sse_head(writer)
            for body in ({"result": {"task": task}}, {"error": failure}):
                event = json.dumps({"jsonrpc": "2.0", "id": rpc_id, **body})
                await self._write(reader, writer, f"data: {event}\n\n".encode())
            return True
        if b == "nosubscribe" and method == "SubscribeToTask":
            failure = {"code": -32004, "message": "resubscription is not supported"}
            self._json(writer, {"jsonrpc": "2.0", "id": rpc_id, "error": failure})
            return True
        if b == "huge" and method == "SendStreamingMessage":
            await self._stream_huge(rpc_id, task, reader, writer)
            return True
        return False

    async def _stream_huge(
        self, rpc_id: Any, task: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """The task, one artifact in appended chunks (each waits for the TCP window), then the end."""

        def event(result: dict) -> bytes:
            return f"data: {json.dumps({'jsonrpc': '2.0', 'id': rpc_id, 'result': result})}\n\n".encode()

        ids = {"taskId": task["id"], "contextId": task["contextId"]}
        self._sse_head(writer)
        await self._write(reader, writer, event({"task": task}))
        parts: list[dict] = []
        task["artifacts"] = [{"artifactId": "huge", "name": "huge.txt", "parts": parts}]
        for i in range(self.huge_chunks):
            part = {"text": huge_chunk(i, self.huge_chunk_chars)}
            parts.append(part)
            update = {
                **ids,
                "artifact": {"artifactId": "huge", "name": "huge.txt", "parts": [part]},
            }
            if i:
                update["append"] = True
            if i == self.huge_chunks - 1:
                update["lastChunk"] = True
            await self._write(reader, writer, event({"artifactUpdate": update}))
        task["status"] = {"state": COMPLETED}
        await self._write(
            reader, writer, event({"statusUpdate": {**ids, "status": {"state": COMPLETED}}})
        )

    # -- A2A
    def _new_task(self, message: dict, state: str) -> dict:
        task_id = str(uuid.uuid4())
        task = {
            "id": task_id,
            "contextId": message.get("contextId") or str(uuid.uuid4()),
            "status": {"state": state},
            "history": [dict(message, taskId=task_id)],
        }
        if state == COMPLETED and self.behaviour == "badtext":
            task["status"] = {"state": COMPLETED, "message": {
                "messageId": "m-bad", "role": "ROLE_AGENT", "parts": [{"text": "status " + BAD_TEXT}],
            }}  # fmt: skip
            task["artifacts"] = [{
                "artifactId": "bad", "name": "name " + BAD_TEXT, "parts": [{"text": "artifact " + BAD_TEXT}],
            }]  # fmt: skip
            task["metadata"] = {"note": "metadata " + BAD_TEXT}
        elif state == COMPLETED:
            task["artifacts"] = [{"artifactId": "a1", "parts": [{"text": "done once"}]}]
        self.tasks[task_id] = task
        return task

    async def _respond(
        self, request: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        method = str(request.get("method", ""))
        rpc_id = request.get("id")
        params = request.get("params") or {}
        self.calls[method] += 1
        self.call_times.append((time.monotonic(), method))

        def ok(result: Any) -> None:
            self._json(writer, {"jsonrpc": "2.0", "id": rpc_id, "result": result})

        def error(code: int, message: str) -> None:
            self._json(
                writer,
                {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}},
            )

        b = self.behaviour
        if method in ("SendMessage", "SendStreamingMessage"):
            message = params.get("message") or {}
            existing = self.tasks.get(message.get("taskId") or "")
            if existing is not None:  # a follow-up (an answer)
                if b == "refuseonce" and existing["id"] not in self.refused:
                    self.refused.add(existing["id"])
                    error(-32602, "this answer is refused (the next one will be taken)")
                    return
                self.answered[existing["id"]] = time.monotonic()
                existing["status"] = {"state": COMPLETED}
                existing["history"].append(message)
                if method == "SendMessage":
                    ok({"task": existing})
                else:
                    self._sse(writer, rpc_id, [{"task": existing}])
                return
            waits = {"authwait": AUTH_REQUIRED, "refuseonce": AUTH_REQUIRED}
            state = {"lostreply": COMPLETED, "badtext": COMPLETED, **waits}.get(b, WORKING)
            task = self._new_task(message, state)
            if await self._misbehave(method, rpc_id, task, reader, writer):
                return
            if b == "lostreply":
                # The agent got the request and created the task; the reply is lost.
                writer.transport.abort()
                return
            if method == "SendMessage":
                ok({"task": task})
                return
            events: list[Any] = [{"task": task}]
            if b == "flood":
                for i in range(self.flood_events):
                    status = {"state": WORKING, "message": {
                        "messageId": f"m-{i}", "role": "ROLE_AGENT", "parts": [{"text": f"tick {i}"}],
                    }}  # fmt: skip
                    events.append(
                        {
                            "statusUpdate": {
                                "taskId": task["id"],
                                "contextId": task["contextId"],
                                "status": status,
                            }
                        }
                    )
            self._sse(writer, rpc_id, events)
            return
        if method == "GetTask":
            task = self.tasks.get(params.get("id") or "")
            if task is None:
                error(-32001, "Task not found")
            elif b == "wrongid":
                ok(dict(task, id="somebody-elses-task"))
            elif b == "unspecified":
                ok(dict(task, status={"state": "TASK_STATE_UNSPECIFIED"}))
            elif b == "forget" and self.calls["GetTask"] > self.forget_after:
                error(-32001, f"Task not found: {task['id']}")
            elif await self._misbehave(method, rpc_id, task, reader, writer):
                pass
            elif b == "garbage":
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n"
                    b"Connection: close\r\n\r\n{not json"
                )
            else:
                ok(task)
            return
        if method == "SubscribeToTask":
            task = self.tasks.get(params.get("id") or "")
            if task is None:
                error(-32001, "Task not found")
            elif b == "forget" and self.calls["GetTask"] >= self.forget_after:
                error(-32001, f"Task not found: {task['id']}")
            elif await self._misbehave(method, rpc_id, task, reader, writer):
                pass
            else:
                self._sse(writer, rpc_id, [{"task": task}])  # then a clean close
            return
        if method == "ListTasks":
            context = params.get("contextId")
            found = [t for t in self.tasks.values() if not context or t["contextId"] == context]
            ok(
                {
                    "tasks": found,
                    "nextPageToken": "",
                    "pageSize": len(found),
                    "totalSize": len(found),
                }
            )
            return
        if method == "CancelTask":
            task = self.tasks.get(params.get("id") or "")
            if task is None:
                error(-32001, "Task not found")
            else:
                task["status"] = {"state": CANCELED}
                ok(task)
            return
        error(-32601, f"Method not found: {method}")


class PeerGone(Exception):
    """The dashboard hung up while the agent was still sending."""


def huge_chunk(index: int, chars: int) -> str:
    """Chunk ``index`` of the ``huge`` artifact: distinct per index, ``chars`` characters long.

    Random base64, so that no database compresses it away (PostgreSQL's TOAST would shrink a
    run of one letter to almost nothing, and the bytes measured would mean little).
    """
    head = f"chunk {index:05d} "
    return (
        head + base64.b64encode(random.Random(index).randbytes(chars)).decode()[: chars - len(head)]
    )


@contextlib.contextmanager
def hostile_servers() -> Iterator[Callable[..., HostileAgent]]:
    """``make("wrongid")`` starts a :class:`HostileAgent`; all are closed on exit."""
    started: list[HostileAgent] = []

    def make(behaviour: str, **options: Any) -> HostileAgent:
        agent = HostileAgent(behaviour, **options).start()
        started.append(agent)
        return agent

    try:
        yield make
    finally:
        for agent in started:
            agent.close()


@pytest.fixture
def hostile() -> Iterator[Callable[..., HostileAgent]]:
    """Factory fixture: ``hostile("wrongid")`` starts a :class:`HostileAgent`, closed after the test."""
    with hostile_servers() as make:
        yield make
