"""Small network helpers shared by ``manage.py up``, the test fixtures and the benchmarks."""

from __future__ import annotations

import errno
import random
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

# Ports are picked below this when the kernel's range for outgoing connections allows it.
LOWEST_PICKED_PORT = 15000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_picker = random.SystemRandom()  # not the global generator, which tests may seed alike


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on right now, for a server that will bind it soon.

    Binding port 0 returns a port from the kernel's ephemeral range, from which it
    also gives the local port of every outgoing connection: on a busy machine (a
    test run's database and Redis connections, two passes side by side) a connection
    could take the port before the server it was meant for bound it. Ports below that
    range go only to whoever binds them by number, so one is picked there at random
    and checked; port 0's answer is the fallback when no room or no free port is found.
    There is still a window until the server binds: callers that can, retry.
    """
    low = _ephemeral_low()
    if low - LOWEST_PICKED_PORT >= 1000:
        for _ in range(50):
            port = _picker.randrange(LOWEST_PICKED_PORT, low)
            if port_available(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (32768 when unknown)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_available(host: str, port: int) -> bool:
    """Can a server bind ``host:port``? (False only for a port in use; see :func:`bind_problem`.)

    SO_REUSEADDR is set as daphne (Twisted) sets it, so a port that only has connections in
    TIME_WAIT counts as free and only a real listener counts as "in use".
    """
    return bind_problem(host, port) is None


def bind_problem(host: str, port: int) -> str | None:
    """Why a server cannot bind ``host:port`` ("in use", or the system's reason), or None.

    A host name that does not resolve, or an address not on this machine, is not a port in
    use: ``up --host`` said so for those, and the operator looked for a process that was
    not there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror as exc:
            return f"the host name does not resolve ({exc.strerror})"
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            return exc.strerror or type(exc).__name__
    return None


def redact_url(url: str) -> str:
    """The URL with its password and its query's values replaced, printable without a secret.

    A password holding ``/``, ``#`` or ``?`` (not percent-encoded) ends the URL's host part
    early, so the parser finds no password at all: whatever stands before the last ``@``
    after the scheme is taken as the credentials then. redis-py and psycopg also take a
    password from the query (``?password=``): every query value is hidden, names kept.
    """
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        credentials, _, tail = rest.rpartition("@")
        user = credentials.split(":", 1)[0] if ":" in credentials else ""
        if ":" in credentials or "/" in credentials or "#" in credentials or "?" in credentials:
            return f"{scheme}://{user}:***@{_without_query_values(tail)}"
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.query:
        parts = parts._replace(query=_query_names(parts.query))
    if parts.password is None:
        return urlunsplit(parts)
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _query_names(query: str) -> str:
    """``a=1&password=x`` -> ``a=***&password=***``: the names stay, the values go."""
    return "&".join(
        f"{item.partition('=')[0]}=***" if "=" in item else item for item in query.split("&")
    )


def _without_query_values(tail: str) -> str:
    head, mark, query = tail.partition("?")
    return f"{head}{mark}{_query_names(query)}" if mark else tail


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
