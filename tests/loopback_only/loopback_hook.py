"""Test-only: every socket connect off loopback is refused and recorded (an audit hook).

Tests talk to agents on 127.0.0.1 and must never send a packet elsewhere, even when the
code under test is broken (an SSRF guard that lets a metadata address through). Python
raises the ``socket.connect`` audit event before the system call, so a hook that raises
stops the connect before any packet. Installed in the pytest process by
``tests/conftest.py`` and in every child process started with this folder on
``PYTHONPATH`` (its ``sitecustomize.py``); children append what they refused to the file
named by ``LOOPBACK_ONLY_LOG``, which the conftest checks after each test.

Name resolution is covered too: every real lookup of a name other than ``localhost``
(``getaddrinfo``, ``gethostbyname``, ``gethostbyaddr``, ``getnameinfo``) is refused, since it
could ask a DNS server off this machine. The names the tests use (``*.test``, ``example.org``,
``dash.example.com``, ...) are stubbed where a lookup is meant to happen; should a stub not be
in place, the lookup is refused here. IP literals are "resolved" without the network and
pass (a connect to one off loopback is refused above), except reverse lookups of addresses
off loopback, which ask DNS.
"""

from __future__ import annotations

import collections
import ipaddress
import os
import sys
from typing import Any

LOG_ENV = "LOOPBACK_ONLY_LOG"
# The only name resolved for real (from /etc/hosts): every other one could ask a DNS server.
LOCAL_NAMES = frozenset({"localhost"})

refused: list[str] = []  # what this process was stopped from doing (never cleared by the hook)
# Every inet connect attempted here, allowed or not (the latest ones).
seen: collections.deque[tuple[str, int]] = collections.deque(maxlen=10_000)
_installed = False


class OffLoopback(ConnectionRefusedError):
    """Raised by the hook: a connect off loopback (or a real lookup of a name)."""


def off_loopback(address: Any) -> str | None:
    """``host:port`` when ``address`` (a ``socket.connect`` argument) is an inet address off loopback."""
    if (
        not isinstance(address, tuple)
        or len(address) < 2
        or not isinstance(address[0], str | bytes)
    ):
        return None  # a Unix socket path, netlink, ...: not the network
    host = address[0].decode() if isinstance(address[0], bytes) else address[0]
    if host == "localhost":
        return None
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return f"{host}:{address[1]}"  # a name: connect() would resolve it itself, unchecked
    mapped = getattr(ip, "ipv4_mapped", None)
    if ip.is_loopback or (mapped is not None and mapped.is_loopback):
        return None
    return f"{ip}:{address[1]}"


def _text(host: Any) -> str | None:
    if isinstance(host, bytes | bytearray):
        return bytes(host).decode(errors="replace")
    return host if isinstance(host, str) else None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _is_loopback(host: str) -> bool:
    if host.rstrip(".").lower() in LOCAL_NAMES:
        return True
    ip = _ip(host)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip is not None and (ip.is_loopback or (mapped is not None and mapped.is_loopback))


def real_lookup(event: str, args: tuple[Any, ...]) -> str | None:
    """The name an audit event would look up for real (possibly over DNS), else ``None``.

    Forward lookups (``getaddrinfo``, ``gethostbyname[_ex]``) pass for ``localhost``, an IP
    literal (no lookup: parsed in place) and no host at all (a wildcard bind); reverse ones
    (``gethostbyaddr``, ``getnameinfo``) only for loopback. Anything else is a name.
    """
    if event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex"):
        host = _text(args[0]) if args else None
        if host is None or host == "" or host.rstrip(".").lower() in LOCAL_NAMES:
            return None
        return None if _ip(host) is not None else host
    if event == "socket.gethostbyaddr":
        host = _text(args[0]) if args else None
        return None if host is None or _is_loopback(host) else host
    if event == "socket.getnameinfo":
        sockaddr = args[0] if args else None
        host = _text(sockaddr[0]) if isinstance(sockaddr, tuple) and sockaddr else None
        return None if host is None or _is_loopback(host) else host
    return None


def _record(what: str) -> None:
    refused.append(what)
    path = os.environ.get(LOG_ENV)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as log:
                log.write(f"{os.getpid()} {' '.join(sys.argv[:3])}: {what}\n")
        except OSError:
            pass  # the exception raised below still stops the connect


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and len(address) >= 2 and isinstance(address[0], str):
            seen.append((address[0], address[1]))
        bad = off_loopback(address)
        if bad is not None:
            _record(f"connect to {bad}")
            raise OffLoopback(
                f"test connect hook: refused to connect to {bad} (tests stay on loopback)"
            )
    elif event.startswith(("socket.getaddrinfo", "socket.gethostby", "socket.getnameinfo")):
        name = real_lookup(event, args)
        if name is not None:
            _record(f"real name lookup of {name}")
            raise OffLoopback(f"test connect hook: {name} must be stubbed, not resolved for real")


def install() -> None:
    """Add the hook (once per process; audit hooks cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
