"""Real A2A peers for tests: the demo agent as a subprocess, a cuttable TCP proxy,
and a deliberately broken HTTP server.

Plain helpers (usable from any test module or benchmark)::

    with running_agent(streaming=True, push=True) as agent: ...
    handle = start_agent(...); ...; handle.stop()
    proxy = TcpProxy("127.0.0.1", agent.port).start(); proxy.cut(); proxy.close()
    bad = BadServer().start(); bad.url_for("html")  # see BadServer

Pytest fixtures (load with ``pytest_plugins = ["tests.agents"]`` or import *):
``agent`` (streaming + push), ``agent_nostream``, ``agent_nopush``,
``agent_token`` (requires bearer ``AGENT_TOKEN``), all session-scoped;
``tcp_proxy`` (a factory ``tcp_proxy(host, port) -> TcpProxy``, closed after
the test), ``webhook`` (a :class:`WebhookReceiver` recording push
notifications) and ``bad_server`` (session-scoped :class:`BadServer`).

The proxy and the bad server each run their own event loop in a daemon
thread, so they serve sync tests (which call ``asyncio.run``) and async tests
alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tasks_app.runtime.net import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENT_TOKEN = "demo-secret-token"

__all__ = [
    "AGENT_TOKEN",
    "AgentHandle",
    "BadServer",
    "ReceivedHook",
    "TcpProxy",
    "WebhookReceiver",
    "agent",
    "agent_nopush",
    "agent_nostream",
    "agent_token",
    "bad_server",
    "free_port",
    "running_agent",
    "start_agent",
    "tcp_proxy",
    "webhook",
]


@dataclass
class AgentHandle:
    """A running demo agent process and its URLs."""

    base_url: str
    port: int
    process: subprocess.Popen[bytes] | None = field(repr=False, default=None)
    log_path: Path | None = None

    @property
    def card_url(self) -> str:
        return f"{self.base_url}/.well-known/agent-card.json"

    @property
    def jsonrpc_url(self) -> str:
        return f"{self.base_url}/jsonrpc"

    @property
    def rest_url(self) -> str:
        return f"{self.base_url}/rest"

    def url_for(self, binding: str) -> str:
        return self.jsonrpc_url if binding.lower() in ("jsonrpc", "json-rpc") else self.rest_url

    def stop(self) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def __enter__(self) -> AgentHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_agent(
    *,
    streaming: bool = True,
    push: bool = True,
    delay: float = 0.05,
    auth_delay: float = 0.5,
    token: str | None = None,
    port: int | None = None,
    startup_timeout: float = 20.0,
) -> AgentHandle:
    """Start ``python -m tasks_app.demo_agent`` on a free loopback port; wait for its card.

    A port picked here can be taken by another process (CI runs two suites at once) before
    the agent binds it: the agent then exits at once, and a picked port is picked again.
    """
    options = dict(streaming=streaming, push=push, delay=delay, auth_delay=auth_delay,
                   token=token, startup_timeout=startup_timeout)  # fmt: skip
    if port:
        return _start_agent_on(port, **options)
    for _ in range(2):
        with contextlib.suppress(PortTaken):
            return _start_agent_on(free_port(), **options)
    return _start_agent_on(free_port(), **options)  # a third taken port is an error


class PortTaken(RuntimeError):
    """The agent could not bind its port: another process had it."""


def _start_agent_on(
    port: int,
    *,
    streaming: bool,
    push: bool,
    delay: float,
    auth_delay: float,
    token: str | None,
    startup_timeout: float,
) -> AgentHandle:
    cmd = [
        sys.executable, "-m", "tasks_app.demo_agent",
        "--host", "127.0.0.1", "--port", str(port),
        "--delay", str(delay), "--auth-delay", str(auth_delay),
    ]  # fmt: skip
    if not streaming:
        cmd.append("--no-streaming")
    if not push:
        cmd.append("--no-push")
    if token:
        cmd += ["--token", token]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log = open(os.devnull, "wb")  # noqa: SIM115 - handed to the child process
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.PIPE)
    log.close()
    handle = AgentHandle(base_url=f"http://127.0.0.1:{port}", port=port, process=proc)
    deadline = time.monotonic() + startup_timeout
    with httpx.Client(timeout=1.0) as http:
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                error = PortTaken if "address already in use" in err.lower() else RuntimeError
                raise error(f"demo agent exited with {proc.returncode}: {err[-2000:]}")
            try:
                if http.get(handle.card_url).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                handle.stop()
                raise RuntimeError(
                    f"demo agent did not answer on {handle.card_url} in {startup_timeout}s"
                )
            time.sleep(0.05)
    # Drain stderr in the background so a chatty agent never blocks on a full pipe.
    if proc.stderr is not None:
        threading.Thread(target=proc.stderr.read, daemon=True).start()
    return handle


@contextlib.contextmanager
def running_agent(**kwargs: Any) -> Iterator[AgentHandle]:
    """Context manager around :func:`start_agent`."""
    handle = start_agent(**kwargs)
    try:
        yield handle
    finally:
        handle.stop()


# --------------------------------------------------------------------------- threads


class _LoopThread:
    """An asyncio loop in a daemon thread, for servers that must outlive test loops."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel whatever still runs on the loop (open handlers), then stop it."""
        if not self.loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.call(cancel_all(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class TcpProxy:
    """A loopback TCP proxy in front of ``target``; :meth:`cut` drops every live connection.

    ``stall()`` keeps connections open but stops forwarding the server's bytes
    (a silent agent); ``resume()`` forwards again. New connections keep working
    after a cut, like a network blip.
    """

    def __init__(self, target_host: str, target_port: int, *, listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._listen_port = listen_port
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._stalled = asyncio.Event()
        self._lt: _LoopThread | None = None
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        self._lt = _LoopThread("tcp-proxy")
        self._lt.call(self._start())
        return self

    async def _start(self) -> None:
        self._stalled = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self._listen_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, downstream: bool
    ) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                while downstream and self._stalled.is_set():
                    await asyncio.sleep(0.05)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        self._writers.update({c_writer, s_writer})
        try:
            await asyncio.gather(
                self._pipe(c_reader, s_writer, downstream=False),
                self._pipe(s_reader, c_writer, downstream=True),
            )
        finally:
            self._writers.discard(c_writer)
            self._writers.discard(s_writer)

    async def _cut(self) -> int:
        n = 0
        for w in list(self._writers):
            transport = w.transport
            if not transport.is_closing():
                n += 1
            transport.abort()
        self._writers.clear()
        return n

    def refuse(self) -> None:
        """Stop listening: new connections are refused (an agent that is down)."""
        assert self._lt is not None, "proxy not started"

        async def _close() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None

        self._lt.call(_close())

    def accept(self) -> None:
        """Listen again on the same port (the agent is back)."""
        assert self._lt is not None, "proxy not started"

        async def _open() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

        self._lt.call(_open())

    def cut(self) -> int:
        """Abort all current connections (both sides); returns how many sockets were cut."""
        assert self._lt is not None, "proxy not started"
        return int(self._lt.call(self._cut()))

    def stall(self) -> None:
        assert self._lt is not None
        self._lt.loop.call_soon_threadsafe(self._stalled.set)

    def resume(self) -> None:
        assert self._lt is not None
        self._lt.loop.call_soon_threadsafe(self._stalled.clear)

    async def _close(self) -> None:
        await self._cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def close(self) -> None:
        if self._lt is None:
            return
        with contextlib.suppress(Exception):
            self._lt.call(self._close())
        self._lt.stop()
        self._lt = None

    def __enter__(self) -> TcpProxy:
        return self.start() if self._lt is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- broken agent


V03_CARD = {
    "name": "Old Agent",
    "description": "Speaks A2A 0.3",
    "version": "0.9",
    "protocolVersion": "0.3.0",
    "url": "http://127.0.0.1:1/a2a",
    "preferredTransport": "JSONRPC",
    "capabilities": {"streaming": True},
    "defaultInputModes": ["text/plain"],
    "defaultOutputModes": ["text/plain"],
    "skills": [{"id": "s", "name": "s", "description": "d", "tags": ["t"]}],
}


class BadServer:
    """A tiny HTTP/1.1 server that misbehaves on purpose, chosen by the first path segment.

    ``url_for(mode)`` gives a base URL usable as a JSON-RPC endpoint *and* as an
    HTTP+JSON base. Modes:

    ``html``          500 with an HTML error page
    ``html200``       200 with an HTML page
    ``wrongtype``     200 ``text/plain``
    ``badjson``       200 ``application/json`` with truncated JSON
    ``v03``           a 0.3-shaped Task (``kind``, lowercase state) as JSON or SSE
    ``oversized``     an SSE event of ``BadServer.big_event_bytes`` bytes
    ``silent``        reads the request, never answers
    ``silentstream``  SSE headers and one valid event, then silence
    ``dropped``       SSE headers, half an event, then the connection is closed
    ``sseerror``      SSE with ``event: error`` carrying a google.rpc.Status
    ``problem``       400 ``application/problem+json``
    ``gateway401``    401 ``text/plain``
    ``echo``          a valid Task whose ``metadata`` echoes request headers/query/path
    ``card03``        serves a 0.3 agent card at the well-known path
    ``legacycard``    404 at agent-card.json, a 1.0 card at the pre-1.0 ``agent.json``
    ``getonly``       REST ``:subscribe`` answers 405 to POST and streams on GET
    ``misroute``      REST ``:subscribe`` POST gets TaskNotFound naming "<id>:subscribe"; GET streams
    ``nocard``        404 everywhere
    """

    big_event_bytes = 200_000

    def __init__(self) -> None:
        self._lt: _LoopThread | None = None
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.subscribe_verbs: list[str] = []

    def url_for(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"

    def start(self) -> BadServer:
        self._lt = _LoopThread("bad-server")
        self._lt.call(self._start())
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._lt is None:
            return

        async def _close() -> None:
            for w in list(self._conns):
                w.transport.abort()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                self._server.close()

        with contextlib.suppress(Exception):
            self._lt.call(_close())
        self._lt.stop()
        self._lt = None

    @staticmethod
    def _response(status: str, ctype: str, body: bytes, extra: str = "") -> bytes:
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n{extra}\r\n"
        )
        return head.encode() + body

    @staticmethod
    def _sse_head() -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)  # type: ignore[arg-type]
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            verb, target, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            body = b""
            if int(headers.get("content-length", "0") or 0):
                body = await reader.readexactly(int(headers["content-length"]))
            await self._respond(verb, target, headers, body, reader, writer)
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            asyncio.LimitOverrunError,
            asyncio.CancelledError,
        ):
            pass
        finally:
            self._conns.discard(writer)
            if me is not None:
                self._tasks.discard(me)  # type: ignore[arg-type]
            with contextlib.suppress(Exception):
                writer.close()

    async def _respond(
        self,
        verb: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        reader: asyncio.StreamReader,
        w: asyncio.StreamWriter,
    ) -> None:
        path, _, query = target.partition("?")
        mode = path.strip("/").split("/", 1)[0]
        rpc_id: Any = None
        method = ""
        with contextlib.suppress(ValueError):
            req = json.loads(body) if body else {}
            if isinstance(req, dict):
                rpc_id = req.get("id")
                method = str(req.get("method", ""))
        is_rpc = rpc_id is not None
        is_stream = "text/event-stream" in headers.get("accept", "") or method in (
            "SendStreamingMessage",
            "SubscribeToTask",
        )

        def result(obj: Any) -> bytes:
            return json.dumps(
                {"jsonrpc": "2.0", "id": rpc_id, "result": obj} if is_rpc else obj
            ).encode()

        task = {"id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_WORKING"}}
        if mode in ("getonly", "misroute") and path.endswith(":subscribe"):
            if verb == "GET":
                w.write(self._sse_head())
                w.write(b"data: " + json.dumps({"task": task}).encode() + b"\n\n")
            elif mode == "getonly":
                w.write(
                    self._response("405 Method Not Allowed", "text/plain", b"Method Not Allowed")
                )
            else:
                tid = path.rsplit("/", 1)[-1]
                err = {
                    "error": {
                        "code": 404,
                        "status": "NOT_FOUND",
                        "message": f"Task {tid} not found",
                        "details": [
                            {
                                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                "reason": "TASK_NOT_FOUND",
                                "domain": "a2a-protocol.org",
                                "metadata": {"taskId": tid},
                            }
                        ],
                    }
                }
                w.write(
                    self._response("404 Not Found", "application/json", json.dumps(err).encode())
                )
            self.subscribe_verbs.append(verb)
        elif mode == "html":
            page = b"<html><body><h1>500 Internal Server Error</h1></body></html>"
            w.write(self._response("500 Internal Server Error", "text/html", page))
        elif mode == "html200":
            w.write(
                self._response(
                    "200 OK",
                    "text/html; charset=utf-8",
                    b"<!doctype html><html><body>Login</body></html>",
                )
            )
        elif mode == "wrongtype":
            w.write(self._response("200 OK", "text/plain", b"hello, I am not an agent"))
        elif mode == "badjson":
            w.write(
                self._response(
                    "200 OK", "application/json", b'{"jsonrpc": "2.0", "result": {"task": '
                )
            )
        elif mode == "v03":
            old = {"kind": "task", "id": "t-1", "contextId": "c-1", "status": {"state": "working"}}
            if is_stream:
                w.write(self._sse_head())
                w.write(b"data: " + result(old) + b"\n\n")
            else:
                w.write(self._response("200 OK", "application/json", result(old)))
        elif mode == "oversized":
            w.write(self._sse_head())
            big = {"task": {**task, "metadata": {"blob": "x" * self.big_event_bytes}}}
            w.write(b"data: " + result(big) + b"\n\n")
        elif mode == "silent":
            await reader.read()  # until the client gives up and closes
        elif mode == "silentstream":
            w.write(self._sse_head())
            w.write(b"data: " + result({"task": task}) + b"\n\n")
            await w.drain()
            await reader.read()
        elif mode == "dropped":
            w.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"data: " + result({"task": task}) + b"\n\n"
            w.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            w.write(b'40\r\ndata: {"statusUp')  # half a chunk, then the line goes dead
            await w.drain()
            await asyncio.sleep(0.05)
            w.transport.abort()
            return
        elif mode == "sseerror":
            w.write(self._sse_head())
            w.write(b"data: " + result({"task": task}) + b"\n\n")
            if is_rpc:
                err = {
                    "jsonrpc": "2.0",
                    "id": rpc_id,
                    "error": {"code": -32603, "message": "agent crashed", "data": None},
                }
            else:
                err = {
                    "error": {
                        "code": 500,
                        "status": "INTERNAL",
                        "message": "agent crashed",
                        "details": [
                            {
                                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                "reason": "INTERNAL_ERROR",
                                "domain": "a2a-protocol.org",
                            }
                        ],
                    }
                }
            w.write(b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n")
        elif mode == "problem":
            prob = {
                "type": "https://a2a-protocol.org/errors/task-not-found",
                "title": "Task not found",
                "status": 404,
                "detail": "no task t-9",
            }
            w.write(
                self._response(
                    "404 Not Found", "application/problem+json", json.dumps(prob).encode()
                )
            )
        elif mode == "gateway401":
            w.write(
                self._response(
                    "401 Unauthorized",
                    "text/plain",
                    b"Unauthorized",
                    "WWW-Authenticate: Bearer\r\n",
                )
            )
        elif mode == "echo":
            sent: Any = None
            with contextlib.suppress(ValueError):
                sent = json.loads(body) if body else None
            echo = {
                **task,
                "metadata": {
                    "headers": headers,
                    "query": query,
                    "path": path,
                    "verb": verb,
                    "body": sent,
                },
            }
            w.write(self._response("200 OK", "application/json", result(echo)))
        elif mode == "legacycard" and path.endswith("/.well-known/agent.json"):
            card = {**V03_CARD, "name": "Legacy path agent"}
            for key in ("url", "preferredTransport", "protocolVersion"):
                card.pop(key)
            card["supportedInterfaces"] = [
                {"url": "/legacycard/rpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
            ]
            w.write(self._response("200 OK", "application/json", json.dumps(card).encode()))
        elif mode == "card03":
            w.write(self._response("200 OK", "application/json", json.dumps(V03_CARD).encode()))
        else:
            w.write(self._response("404 Not Found", "text/plain", b"not found"))
        await w.drain()


@dataclass
class ReceivedHook:
    path: str
    headers: dict[str, str]
    body: Any


class WebhookReceiver:
    """Records push notifications (POSTs) and answers 204; ``received`` lists them."""

    def __init__(self) -> None:
        self._lt: _LoopThread | None = None
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        self.received: list[ReceivedHook] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> WebhookReceiver:
        self._lt = _LoopThread("webhook")

        async def _start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._lt.call(_start())
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: several notifications may share a connection
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                _, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                parsed: Any = None
                with contextlib.suppress(ValueError):
                    parsed = json.loads(body)
                self.received.append(ReceivedHook(target, headers, parsed))
                writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def wait_for(
        self, predicate: Callable[[list[ReceivedHook]], bool], timeout: float = 10.0
    ) -> list[ReceivedHook]:
        deadline = time.monotonic() + timeout
        while not predicate(list(self.received)):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"webhook condition not met; received {len(self.received)} notifications"
                )
            time.sleep(0.02)
        return list(self.received)

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


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def agent() -> Iterator[AgentHandle]:
    """Demo agent with streaming and push (one process for the whole session)."""
    with running_agent(streaming=True, push=True) as handle:
        yield handle


@pytest.fixture(scope="session")
def agent_nostream() -> Iterator[AgentHandle]:
    with running_agent(streaming=False, push=True) as handle:
        yield handle


@pytest.fixture(scope="session")
def agent_nopush() -> Iterator[AgentHandle]:
    with running_agent(streaming=True, push=False) as handle:
        yield handle


@pytest.fixture(scope="session")
def agent_token() -> Iterator[AgentHandle]:
    """Demo agent that requires ``Authorization: Bearer AGENT_TOKEN``."""
    with running_agent(token=AGENT_TOKEN) as handle:
        yield handle


@pytest.fixture
def tcp_proxy() -> Iterator[Callable[..., TcpProxy]]:
    """Factory: ``tcp_proxy(host, port)`` starts a :class:`TcpProxy`, closed after the test."""
    proxies: list[TcpProxy] = []

    def make(target_host: str, target_port: int) -> TcpProxy:
        proxy = TcpProxy(target_host, target_port).start()
        proxies.append(proxy)
        return proxy

    yield make
    for p in proxies:
        p.close()


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    """A fresh :class:`WebhookReceiver` for one test."""
    receiver = WebhookReceiver().start()
    yield receiver
    receiver.close()


@pytest.fixture(scope="session")
def bad_server() -> Iterator[BadServer]:
    server = BadServer().start()
    yield server
    server.close()
