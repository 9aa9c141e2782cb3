"""Tiny stdlib HTTP peers on loopback, served from a thread for the length of a test."""

from __future__ import annotations

import contextlib
import json
import socketserver
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

# How often the serving loop looks for shutdown(): the default (0.5 s) made every stop wait
# half a second, in every test with such a peer.
POLL_SECONDS = 0.02


def serve_in_thread(server: socketserver.BaseServer) -> None:
    """Serve ``server`` on a daemon thread; stop it with :func:`stop_serving`."""
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": POLL_SECONDS}, daemon=True
    ).start()


def stop_serving(server: socketserver.BaseServer) -> None:
    server.shutdown()
    server.server_close()


class RpcError(Exception):
    """Raised by a peer's ``answer``: the call is answered with this JSON-RPC error."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@contextlib.contextmanager
def json_rpc_peer(answer: Callable[[dict], Any]) -> Iterator[str]:
    """A JSON-RPC agent whose every call is answered ``{"result": answer(request)}`` (or the
    error ``answer`` raised as :class:`RpcError`); its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            reply: dict[str, Any] = {"jsonrpc": "2.0", "id": body.get("id")}
            try:
                reply["result"] = answer(body)
            except RpcError as exc:
                reply["error"] = {"code": exc.code, "message": exc.message}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serve_in_thread(server)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stop_serving(server)


def loopback_client(**kwargs: Any) -> httpx.AsyncClient:
    """A plain client for a test's peers on loopback, with the process's one SSL context.

    ``httpx.AsyncClient()`` builds an SSL context of its own, about 30 ms of CPU reading
    the certificate store, even for plain HTTP: 5 s of the fast tier, one client a test.
    """
    from tasks_app.outbound import shared_ssl_context  # the models: after Django's setup

    return httpx.AsyncClient(verify=shared_ssl_context(), **kwargs)
