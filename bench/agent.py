"""A lightweight A2A 1.0 streaming agent for benchmarks (JSON-RPC binding).

Why not the demo agent: the benchmarks need thousands of concurrent streams from
one process at a known rate, with the emit time of every event in the event, so
latency can be measured from the agent to the browser. The a2a-sdk server is
correct but costly per event; this one is a small Starlette app that speaks just
enough of the protocol (the same wire shapes the SDK produces):

* ``GET /.well-known/agent-card.json`` - a card with ``capabilities.streaming``;
* ``POST /jsonrpc`` ``SendStreamingMessage`` - an SSE stream: ``{"task": ...}``
  (SUBMITTED), then ``statusUpdate`` events (WORKING) at the message's rate, then
  COMPLETED. Each event's ``metadata`` carries ``emitted`` (``time.time()`` at
  emission) and ``i`` (its index);
* ``SubscribeToTask`` - first a task snapshot, then the task's live events
  (-32004 as plain JSON on a terminal task, like the SDK);
* ``GetTask``, ``SendMessage`` (returns the task at once), ``CancelTask``;
* ``GET /bench/stats`` - how many events each task has emitted (for loss counts).

The message text says what to do: ``bench EVENTS INTERVAL [START_DELAY]``, e.g.
``bench 20 1.0`` is 20 events one second apart. A task keeps running when its
stream's client goes away (as remote tasks do), so a resubscriber sees it go on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TERMINAL = {
    "TASK_STATE_COMPLETED",
    "TASK_STATE_FAILED",
    "TASK_STATE_CANCELED",
    "TASK_STATE_REJECTED",
}
KEEPALIVE_SECONDS = 15.0


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class BenchTask:
    """One task on the agent: its snapshot, its subscribers, its emitter."""

    id: str
    context_id: str
    message: dict
    events: int
    interval: float
    start_delay: float
    state: str = "TASK_STATE_SUBMITTED"
    timestamp: str = field(default_factory=now_iso)
    emitted: int = 0
    subscribers: set[asyncio.Queue[dict | None]] = field(default_factory=set)
    runner: asyncio.Task[None] | None = None

    def snapshot(self) -> dict:
        return {
            "id": self.id,
            "contextId": self.context_id,
            "status": {"state": self.state, "timestamp": self.timestamp},
            "history": [self.message],
            "metadata": {"emitted": self.emitted},
        }

    def status_event(self, state: str, i: int) -> dict:
        self.state, self.timestamp = state, now_iso()
        return {
            "statusUpdate": {
                "taskId": self.id,
                "contextId": self.context_id,
                "status": {"state": state, "timestamp": self.timestamp},
                "metadata": {"emitted": time.time(), "i": i},
            }
        }

    def publish(self, event: dict | None) -> None:
        for queue in list(self.subscribers):
            queue.put_nowait(event)

    async def run(self) -> None:
        """Emit the events on schedule (no drift: each is due at start + k * interval)."""
        loop = asyncio.get_running_loop()
        try:
            start = loop.time() + self.start_delay
            for i in range(self.events):
                await asyncio.sleep(max(0.0, start + (i + 1) * self.interval - loop.time()))
                if self.state in TERMINAL:
                    return
                self.emitted += 1
                self.publish(self.status_event("TASK_STATE_WORKING", i))
            await asyncio.sleep(max(0.0, start + (self.events + 1) * self.interval - loop.time()))
            if self.state not in TERMINAL:
                self.emitted += 1
                self.publish(self.status_event("TASK_STATE_COMPLETED", self.events))
        finally:
            self.publish(None)


class Agent:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.tasks: dict[str, BenchTask] = {}

    def card(self) -> dict:
        return {
            "name": "Bench Agent",
            "description": "Emits timestamped status updates at a set rate (benchmarks).",
            "version": "1.0.0",
            "supportedInterfaces": [
                {
                    "url": f"{self.base_url}/jsonrpc",
                    "protocolBinding": "JSONRPC",
                    "protocolVersion": "1.0",
                }
            ],
            "capabilities": {"streaming": True, "pushNotifications": False},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [
                {
                    "id": "bench",
                    "name": "Bench",
                    "description": "bench EVENTS INTERVAL",
                    "tags": ["bench"],
                }
            ],
        }

    def create(self, message: dict) -> BenchTask:
        text = " ".join(
            p.get("text", "") for p in message.get("parts") or [] if isinstance(p, dict)
        )
        words = text.split()
        numbers = [float(w) for w in words[1:4] if _is_number(w)]
        events = int(numbers[0]) if numbers else 10
        interval = numbers[1] if len(numbers) > 1 else 1.0
        start_delay = numbers[2] if len(numbers) > 2 else 0.0
        task = BenchTask(
            id=uuid.uuid4().hex,
            context_id=message.get("contextId") or uuid.uuid4().hex,
            message={**message, "contextId": message.get("contextId") or ""},
            events=events,
            interval=interval,
            start_delay=start_delay,
        )
        task.message["taskId"] = task.id
        task.message["contextId"] = task.context_id
        self.tasks[task.id] = task
        return task

    def start(self, task: BenchTask) -> None:
        task.runner = asyncio.get_running_loop().create_task(task.run())


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _error(rpc_id: Any, code: int, message: str) -> JSONResponse:
    return JSONResponse(
        {"jsonrpc": "2.0", "id": rpc_id, "error": {"code": code, "message": message}}
    )


def _sse(
    rpc_id: Any, first: dict | None, queue: asyncio.Queue[dict | None], task: BenchTask
) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield _frame(rpc_id, first)
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                if event is None:
                    return
                yield _frame(rpc_id, event)
        finally:
            task.subscribers.discard(queue)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


def _frame(rpc_id: Any, result: dict) -> bytes:
    return (
        b"data: "
        + json.dumps({"jsonrpc": "2.0", "id": rpc_id, "result": result}).encode()
        + b"\n\n"
    )


def build_app(base_url: str) -> Starlette:
    agent = Agent(base_url)

    async def card(request: Request) -> Response:
        return JSONResponse(agent.card())

    async def stats(request: Request) -> Response:
        return JSONResponse(
            {tid: {"emitted": t.emitted, "state": t.state} for tid, t in agent.tasks.items()}
        )

    async def jsonrpc(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(None, -32700, "parse error")
        rpc_id, method, params = body.get("id"), body.get("method"), body.get("params") or {}
        if method in ("SendStreamingMessage", "SendMessage"):
            message = params.get("message") or {}
            if message.get("taskId") and message["taskId"] in agent.tasks:
                return _error(
                    rpc_id, -32004, "follow-up messages are not supported by the bench agent"
                )
            task = agent.create(message)
            if method == "SendMessage":
                agent.start(task)
                return JSONResponse(
                    {"jsonrpc": "2.0", "id": rpc_id, "result": {"task": task.snapshot()}}
                )
            queue: asyncio.Queue[dict | None] = asyncio.Queue()
            task.subscribers.add(queue)
            first = {"task": task.snapshot()}
            agent.start(task)
            return _sse(rpc_id, first, queue, task)
        task = agent.tasks.get(str(params.get("id") or ""))
        if task is None:
            return _error(rpc_id, -32001, "task not found")
        if method == "GetTask":
            return JSONResponse({"jsonrpc": "2.0", "id": rpc_id, "result": task.snapshot()})
        if method == "SubscribeToTask":
            if task.state in TERMINAL:
                return _error(rpc_id, -32004, "task is terminal")
            queue = asyncio.Queue()
            task.subscribers.add(queue)
            return _sse(rpc_id, {"task": task.snapshot()}, queue, task)
        if method == "CancelTask":
            if task.state in TERMINAL:
                return _error(rpc_id, -32002, "task cannot be canceled")
            task.publish(task.status_event("TASK_STATE_CANCELED", -1))
            task.publish(None)
            return JSONResponse({"jsonrpc": "2.0", "id": rpc_id, "result": task.snapshot()})
        return _error(rpc_id, -32601, f"method {method!r} not found")

    return Starlette(
        routes=[
            Route("/.well-known/agent-card.json", card),
            Route("/bench/stats", stats),
            Route("/jsonrpc", jsonrpc, methods=["POST"]),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    app = build_app(f"http://{args.host}:{args.port}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                backlog=4096, timeout_keep_alive=30)  # fmt: skip


if __name__ == "__main__":
    main()
