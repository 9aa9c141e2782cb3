"""Tiny stdlib HTTP peers on loopback, served from a thread for the length of a test."""

from __future__ import annotations

import socketserver
import threading

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
