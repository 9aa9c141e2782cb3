"""``free_port``: a port for a server to bind, away from where outgoing connections get theirs.

A port from binding port 0 is one the kernel also hands out as the local port of
outgoing connections; picked there, it could be taken by one of them before the
server bound it (CI runs two suites at once, each with its database and Redis
connections).
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tasks_app.runtime import net


def bind_as_a_server_does(port: int) -> None:
    """Bind 127.0.0.1:port with SO_REUSEADDR, as daphne, uvicorn and Redis do."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


def test_a_picked_port_is_below_the_outgoing_range_and_bindable() -> None:
    low = net._ephemeral_low()
    picked = {net.free_port() for _ in range(20)}
    assert all(net.LOWEST_PICKED_PORT <= port < low for port in picked)
    assert len(picked) > 1  # picked at random, not the same one each time
    for port in picked:
        bind_as_a_server_does(port)


def test_a_port_something_listens_on_is_not_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            other.bind(("127.0.0.1", 0))
            idle = other.getsockname()[1]  # free again once closed
        # The first two tries land on the busy port; the third is taken.
        tries = iter([busy, busy, idle])
        monkeypatch.setattr(net._picker, "randrange", lambda low, high: next(tries))
        monkeypatch.setattr(net, "_ephemeral_low", lambda: 65535)
        assert net.free_port() == idle


def test_without_room_below_the_range_the_kernel_picks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t65535\n")
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", str(ranges))
    assert net._ephemeral_low() == 1024
    monkeypatch.setattr(net._picker, "randrange", lambda *_: pytest.fail("no room to pick in"))
    bind_as_a_server_does(net.free_port())


def test_an_unreadable_range_is_taken_as_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", str(tmp_path / "missing"))
    assert net._ephemeral_low() == 32768
    (tmp_path / "garbled").write_text("not numbers")
    monkeypatch.setattr(net, "EPHEMERAL_RANGE_FILE", str(tmp_path / "garbled"))
    assert net._ephemeral_low() == 32768
