"""One synchronous Redis client per process (and URL), for short calls from any thread.

redis-py clients are thread-safe (a pool underneath), and building one per call would open
a connection per call. Timeouts are short: a call that cannot reach Redis fails quickly and
its caller decides what that means.
"""

from __future__ import annotations

import threading

import redis

_lock = threading.Lock()
_clients: dict[str, redis.Redis] = {}


def client(url: str) -> redis.Redis:
    found = _clients.get(url)
    if found is None:
        with _lock:
            found = _clients.get(url)
            if found is None:
                found = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
                _clients[url] = found
    return found
