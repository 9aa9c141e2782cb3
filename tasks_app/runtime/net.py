"""Small network helpers shared by ``manage.py up`` and the test fixtures."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel considers free right now (there is a small race until it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_available(host: str, port: int) -> bool:
    """Can a server bind ``host:port``?

    SO_REUSEADDR is set as daphne (Twisted) sets it, so a port that only has connections in
    TIME_WAIT counts as free and only a real listener counts as "in use".
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def redact_url(url: str) -> str:
    """The URL with its password replaced, so it can be printed without leaking a secret."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    *,
    interval: float = 0.2,
    abort: Callable[[], bool] | None = None,
) -> bool:
    """Poll ``predicate`` until it is true (True), the timeout passes or ``abort`` says so (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if abort is not None and abort():
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
