"""A small HTTP/1.1 load generator for P10: ``python -m bench.loadgen SPEC OUT``.

Why not httpx: on this two-core machine the load generator shares the CPU with the
server it measures, and httpx spends several hundred microseconds of Python per
request (its models, its pool, its event hooks). This client writes a prepared
request on a kept-alive connection and reads the status line, the headers and a
``Content-Length`` (or chunked) body: a few tens of microseconds. It imports
nothing of Django and runs in its own process, so the server's CPU is not its own.

SPEC (JSON): ``port``, ``concurrency`` (connections in flight), ``rate`` (requests
per second, open loop: request *i* is due at ``start + i / rate`` and its latency
counts from then, so a server that falls behind is charged for the wait; 0 means
closed loop, each connection sends its next request when the last is answered),
``start`` (a ``time.time()`` to begin at, so two generators can overlap) and
``requests``: ``[source address, method, path, {header: value}, body]``. A request
goes out on a connection bound to its source address (any 127.0.0.0/8 address
reaches 127.0.0.1 on Linux), so per-source limits see distinct senders; the
connections are opened before ``start``.

OUT (JSON): ``{"results": [[due offset, latency, status], ...], "started", "ended", "cpu"}``,
status 0 for a connection error; ``cpu`` is the generator's own CPU seconds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any


class Connection:
    """One kept-alive HTTP/1.1 connection from a given source address."""

    def __init__(self, port: int, source: str) -> None:
        self.port, self.source = port, source
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        local = (self.source, 0) if self.source and self.source != "127.0.0.1" else None
        self.reader, self.writer = await asyncio.open_connection(
            "127.0.0.1", self.port, local_addr=local
        )

    async def request(self, data: bytes) -> int:
        if self.writer is None:
            await self.connect()
        assert self.reader is not None and self.writer is not None
        self.writer.write(data)
        line = await self.reader.readline()
        if not line:
            raise ConnectionError("closed by the server")
        status = int(line.split()[1])
        length, chunked, close = 0, False, False
        while True:
            header = await self.reader.readline()
            if header in (b"\r\n", b""):
                break
            name, _, value = header.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length:
            await self.reader.readexactly(length)
        if close:
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def prepare(method: str, path: str, headers: dict[str, str], body: str) -> bytes:
    data = body.encode()
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(data)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    port, rate, concurrency = (
        int(spec["port"]),
        float(spec.get("rate") or 0),
        int(spec["concurrency"]),
    )
    requests = [(src, prepare(m, p, h, b)) for src, m, p, h, b in spec["requests"]]
    results: list[list[float]] = [[0.0, 0.0, 0] for _ in requests]
    idle: dict[str, list[Connection]] = {}
    queue: asyncio.Queue[int | None] = asyncio.Queue()
    # Connections are opened before the clock starts, one after another, as an agent's pool
    # would hold them: a burst of hundreds of connects overflows the server's listen backlog
    # (Twisted's default is 50) and the overflow waits a SYN retry (a second), which would
    # measure the burst, not the webhook.
    per_source: dict[str, int] = {}
    for source, _ in requests:
        per_source[source] = per_source.get(source, 0) + 1
    share = max(1, concurrency // len(per_source)) if per_source else 0
    for source, count in per_source.items():
        for _ in range(min(share, count)):
            conn = Connection(port, source)
            await conn.connect()
            idle.setdefault(source, []).append(conn)
    start = max(float(spec.get("start") or 0), time.time())
    await asyncio.sleep(start - time.time())
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        source, data = requests[i]
        due = i / rate if rate else time.perf_counter() - t0
        pool = idle.setdefault(source, [])
        reused = bool(pool)
        conn = pool.pop() if pool else Connection(port, source)
        errors = (OSError, ConnectionError, ValueError, IndexError, asyncio.IncompleteReadError)
        try:
            status = await conn.request(data)
        except errors:
            conn.close()
            status = 0
            if reused:
                # A kept-alive connection the server closed while it sat idle (its keep-alive
                # timeout): sent again once on a new one, as HTTP clients' pools do; the
                # latency still counts from when the request was due.
                try:
                    status = await conn.request(data)
                except errors:
                    conn.close()
                    status = 0
        results[i] = [due, time.perf_counter() - t0 - due, status]
        if conn.writer is not None:
            pool.append(conn)

    async def worker() -> None:
        while (i := await queue.get()) is not None:
            await one(i)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    if rate:
        for i in range(len(requests)):
            wait = t0 + i / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            queue.put_nowait(i)
    else:
        for i in range(len(requests)):
            queue.put_nowait(i)
    for _ in workers:
        queue.put_nowait(None)
    await asyncio.gather(*workers)
    ended = time.time()
    for pool in idle.values():
        for conn in pool:
            conn.close()
    # Its own CPU time: on a small machine the measuring client competes with the server.
    return {"results": results, "started": start, "ended": ended, "cpu": time.process_time()}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    try:  # libuv's loop: less of the shared CPU for the client (uvloop comes with the webhook part)
        import uvloop

        out = uvloop.run(run(spec))
    except ImportError:
        out = asyncio.run(run(spec))
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
