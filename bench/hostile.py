"""Misbehaving A2A 1.0 agents for the noisy-neighbour benchmark (P9), in one process.

Why a raw asyncio server and not the bench agent: these agents break the
protocol on purpose (answers about another task, a state that does not exist,
bodies that are not JSON, bytes that trickle, events near the size limit,
page tokens that repeat), which a real server framework would refuse to send.
Each agent listens on its own port of 127.0.0.1 (so the dashboard registers
ten distinct agents, each with a card) and speaks JSON-RPC over HTTP/1.1, one
request per connection. They run in a process of their own so that writing a
flood or 7 MB events costs the agent's CPU, not the measuring client's.

Behaviours (the ways of issue 9):

``wrongid-stream`` / ``wrongid-poll``
    GetTask answers a task with another id; SubscribeToTask sends the right
    snapshot and closes at once while the task goes on.
``unspecified-stream`` / ``unspecified-poll``
    GetTask (and the resubscription snapshot) report ``TASK_STATE_UNSPECIFIED``.
``flood``       every stream carries distinct status updates as fast as the
                reader takes them, without end.
``huge``        every stream carries artifact chunks of ``--huge-bytes`` each
                (just under the dashboard's event size limit), without end.
``trickle``     streams send the task, then one byte a second of an event
                that never ends; GetTask trickles one byte a second.
``repeat-tokens`` ListTasks pages cycle through three ``nextPageToken`` values
                forever (an import walk must notice the repeat).
``garbage``     GetTask answers a body that is not JSON.
``quietclose``  streams close at once on a task that goes on; GetTask is correct.

``GET /stats`` on the control port answers, per agent, the requests it got by
method and the bytes it sent, so the benchmark reports what the dashboard's
watchers made each agent do.

Usage: ``python -m bench.hostile --control-port P --agent NAME:BEHAVIOUR:PORT ...
[--ports-file F]`` (a port of 0: any free one, written to F).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

WORKING = "TASK_STATE_WORKING"
CANCELED = "TASK_STATE_CANCELED"

# Behaviour -> does the card declare streaming (the dashboard then follows by stream).
BEHAVIOURS: dict[str, bool] = {
    "wrongid-stream": True,
    "wrongid-poll": False,
    "unspecified-stream": True,
    "unspecified-poll": False,
    "flood": True,
    "huge": True,
    "trickle": True,
    "repeat-tokens": False,
    "garbage": False,
    "quietclose": True,
}
# Tasks a repeat-tokens agent lists besides those started on it (an import mirrors them).
LISTED_EXTRA = 3
READ_TIMEOUT = 30.0


class HostileAgent:
    """One misbehaving agent: its tasks, and counts of what it was asked and what it sent."""

    def __init__(self, name: str, behaviour: str, port: int, huge_bytes: int) -> None:
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}")
        self.name, self.behaviour, self.port, self.huge_bytes = name, behaviour, port, huge_bytes
        self.tasks: dict[str, dict] = {}
        self.calls: Counter[str] = Counter()
        self.bytes_sent = 0
        if behaviour == "repeat-tokens":
            for i in range(LISTED_EXTRA):
                self._new_task(
                    {"messageId": f"listed-{i}", "role": "ROLE_USER", "parts": [{"text": "listed"}]}
                )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def card(self) -> dict:
        return {
            "name": f"Hostile {self.name}",
            "description": f"Misbehaves on purpose ({self.behaviour}); benchmark P9.",
            "version": "1.0.0",
            "supportedInterfaces": [
                {
                    "url": f"{self.base_url}/jsonrpc",
                    "protocolBinding": "JSONRPC",
                    "protocolVersion": "1.0",
                }
            ],
            "capabilities": {"streaming": BEHAVIOURS[self.behaviour], "pushNotifications": False},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [
                {
                    "id": "hostile",
                    "name": "Hostile",
                    "description": self.behaviour,
                    "tags": ["bench"],
                }
            ],
        }

    def stats(self) -> dict:
        return {
            "behaviour": self.behaviour,
            "requests": sum(self.calls.values()),
            "calls": dict(self.calls),
            "bytes": self.bytes_sent,
        }

    # -- HTTP ------------------------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            first, *lines = head.decode("latin-1").split("\r\n")
            verb, path = [*first.split(" "), "", ""][:2]
            headers = {}
            for line in lines:
                if ":" in line:
                    key, value = line.split(":", 1)
                    headers[key.strip().lower()] = value.strip()
            length = int(headers.get("content-length") or 0)
            body = (
                await asyncio.wait_for(reader.readexactly(length), READ_TIMEOUT) if length else b""
            )
            if verb == "GET" and path.startswith("/.well-known/agent-card.json"):
                self.calls["card"] += 1
                self._json(writer, self.card())
            elif verb == "POST" and path.startswith("/jsonrpc"):
                await self._rpc(json.loads(body) if body else {}, writer)
            else:
                self._write(
                    writer,
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                )
            await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            ValueError,
        ):
            pass  # a client that went away, or a request we cannot read: nothing to answer
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        self.bytes_sent += len(data)
        writer.write(data)

    def _json(self, writer: asyncio.StreamWriter, obj: Any) -> None:
        self._raw_json(writer, json.dumps(obj).encode())

    def _raw_json(self, writer: asyncio.StreamWriter, body: bytes) -> None:
        self._write(
            writer,
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body,
        )

    def _frame(self, rpc_id: Any, result: dict) -> bytes:
        return (
            b"data: "
            + json.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": result}).encode()
            + b"\n\n"
        )

    # -- A2A -------------------------------------------------------------------------------------
    def _new_task(self, message: dict) -> dict:
        task_id = uuid.uuid4().hex
        context_id = message.get("contextId") or uuid.uuid4().hex
        task = {
            "id": task_id,
            "contextId": context_id,
            "status": {"state": WORKING},
            "history": [dict(message, taskId=task_id, contextId=context_id)],
        }
        self.tasks[task_id] = task
        return task

    def _with_state(self, task: dict, state: str) -> dict:
        return dict(task, status={"state": state})

    async def _rpc(self, request: dict, writer: asyncio.StreamWriter) -> None:
        method = str(request.get("method", ""))
        rpc_id = request.get("id")
        params = request.get("params") or {}
        self.calls[method] += 1
        b = self.behaviour

        def ok(result: Any) -> None:
            self._json(writer, {"jsonrpc": "2.0", "id": rpc_id, "result": result})

        def error(code: int, message: str) -> None:
            self._json(
                writer,
                {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}},
            )

        if method in ("SendMessage", "SendStreamingMessage"):
            task = self._new_task(params.get("message") or {})
            if method == "SendMessage":
                ok({"task": task})
            else:
                await self._stream(writer, rpc_id, task, {"task": task})
            return
        if method == "ListTasks":
            await self._list(params, ok)
            return
        task = self.tasks.get(str(params.get("id") or ""))
        if task is None:
            error(-32001, "Task not found")
            return
        if method == "GetTask":
            if b.startswith("wrongid"):
                ok(dict(task, id="somebody-elses-task"))
            elif b.startswith("unspecified"):
                ok(self._with_state(task, "TASK_STATE_UNSPECIFIED"))
            elif b == "garbage":
                self._raw_json(writer, b"{not json")
            elif b == "trickle":
                self._write(
                    writer,
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n",
                )
                await self._trickle(writer)
            else:
                ok(task)
            return
        if method == "SubscribeToTask":
            first = (
                self._with_state(task, "TASK_STATE_UNSPECIFIED")
                if b == "unspecified-stream"
                else task
            )
            await self._stream(writer, rpc_id, task, {"task": first})
            return
        if method == "CancelTask":
            task["status"] = {"state": CANCELED}
            ok(task)
            return
        error(-32601, f"Method not found: {method}")

    async def _list(self, params: dict, ok: Any) -> None:
        context = params.get("contextId")
        found = [t for t in self.tasks.values() if not context or t["contextId"] == context]
        token = ""
        if self.behaviour == "repeat-tokens":
            # None -> t0 -> t1 -> t2 -> t0 ...: a cycle that never ends by itself.
            given = str(params.get("pageToken") or "")
            index = int(given[1:]) + 1 if given.startswith("t") and given[1:].isdigit() else 0
            token = f"t{index % 3}"
        ok(
            {
                "tasks": found,
                "nextPageToken": token,
                "pageSize": len(found),
                "totalSize": len(found),
            }
        )

    async def _stream(
        self, writer: asyncio.StreamWriter, rpc_id: Any, task: dict, first: dict
    ) -> None:
        """An SSE response: the first event, then whatever the behaviour does (until the client leaves)."""
        self._write(
            writer,
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\n"
            b"Connection: close\r\n\r\n",
        )
        self._write(writer, self._frame(rpc_id, first))
        await writer.drain()
        b = self.behaviour
        if b == "flood":
            await self._flood(writer, rpc_id, task)
        elif b == "huge":
            await self._huge(writer, rpc_id, task)
        elif b == "trickle":
            self._write(writer, b'data: {"jsonrpc": "2.0", ')
            await self._trickle(writer)
        # every other behaviour: a clean close on a task that goes on

    async def _flood(self, writer: asyncio.StreamWriter, rpc_id: Any, task: dict) -> None:
        i = 0
        while not writer.is_closing():
            for _ in range(50):
                if writer.is_closing():
                    return
                i += 1
                status = {"state": WORKING, "message": {
                    "messageId": f"{task['id']}-{time.monotonic_ns()}-{i}", "role": "ROLE_AGENT",
                    "parts": [{"text": f"tick {i}"}],
                }}  # fmt: skip
                update = {"taskId": task["id"], "contextId": task["contextId"], "status": status}
                self._write(writer, self._frame(rpc_id, {"statusUpdate": update}))
            await writer.drain()  # the reader's TCP window paces the flood

    async def _huge(self, writer: asyncio.StreamWriter, rpc_id: Any, task: dict) -> None:
        filler = "x" * max(0, self.huge_bytes - 400)
        i = 0
        while not writer.is_closing():
            i += 1
            chunk = {
                "artifactId": "huge",
                "parts": [{"text": f"chunk {i} {time.time()} " + filler}],
            }
            update = {"taskId": task["id"], "contextId": task["contextId"], "artifact": chunk,
                      "append": i > 1, "lastChunk": False}  # fmt: skip
            self._write(writer, self._frame(rpc_id, {"artifactUpdate": update}))
            await writer.drain()

    async def _trickle(self, writer: asyncio.StreamWriter) -> None:
        while not writer.is_closing():
            self._write(writer, b" ")
            await writer.drain()
            await asyncio.sleep(1.0)


async def serve(
    specs: list[tuple[str, str, int]],
    control_port: int,
    huge_bytes: int,
    ports_file: Path | None = None,
) -> None:
    """Serve every agent and the control port; port 0 means "any free one".

    With ``ports_file``, the ports bound are written there (JSON, the control port under
    ``"control"``) once every socket listens: a parent that picks free ports itself and
    passes them in can lose one to another process between the pick and the bind.
    """
    agents = [HostileAgent(name, behaviour, port, huge_bytes) for name, behaviour, port in specs]
    servers = []
    for a in agents:
        server = await asyncio.start_server(a.handle, "127.0.0.1", a.port, backlog=1024)
        a.port = server.sockets[0].getsockname()[1]
        servers.append(server)

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            body = json.dumps({a.name: a.stats() for a in agents}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
            await writer.drain()
        except (
            TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    control_server = await asyncio.start_server(control, "127.0.0.1", control_port)
    servers.append(control_server)
    if ports_file is not None:
        bound = {a.name: a.port for a in agents}
        bound["control"] = control_server.sockets[0].getsockname()[1]
        # Written whole, then renamed: a reader never sees half of it.
        partial = ports_file.with_suffix(".partial")
        partial.write_text(json.dumps(bound))
        partial.replace(ports_file)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def parse_spec(text: str) -> tuple[str, str, int]:
    name, behaviour, port = text.split(":")
    if behaviour not in BEHAVIOURS:
        raise argparse.ArgumentTypeError(
            f"unknown behaviour {behaviour!r}; choose from {', '.join(BEHAVIOURS)}"
        )
    return name, behaviour, int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument(
        "--agent", type=parse_spec, action="append", required=True, help="NAME:BEHAVIOUR:PORT"
    )
    parser.add_argument("--huge-bytes", type=int, default=7 * 1024 * 1024)
    parser.add_argument("--ports-file", type=Path, help="write the ports bound here (JSON)")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.agent, args.control_port, args.huge_bytes, args.ports_file))


if __name__ == "__main__":
    main()
