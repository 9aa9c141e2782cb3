"""Daphne takes in at most ``REQUEST_MAX_BODY_BYTES`` of a request body (``runtime.request_bodies``).

Twisted, under daphne, wrote every body whole to a temporary file before the application
saw the request: an anonymous POST of any size filled this machine's disk, whatever Django
or the webhook then refused. A real daphne, raw sockets (an HTTP client would not send a
body it was already answered for, nor keep sending one the server closed).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

LIMIT = 1024 * 1024

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def server(start_daphne):
    return start_daphne(REQUEST_MAX_BODY_BYTES=str(LIMIT))


def spooled_bytes(pid: int) -> int:
    """Bytes in the files ``pid`` holds open that were deleted (Twisted's temporary files)."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if os.readlink(fd).endswith("(deleted)"):
                total += fd.stat().st_size
    return total


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1"
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def read_answer(sock: socket.socket) -> bytes:
    received = b""
    with contextlib.suppress(ConnectionResetError, TimeoutError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_the_default_bound_admits_the_largest_form() -> None:
    """Its default is written out in the settings (they cannot import the forms): the
    largest form, every field and every file at its own limit, must still fit."""
    from django.conf import settings

    from tasks_app.forms import MAX_UPLOAD_BYTES

    largest = (
        settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        + settings.DATA_UPLOAD_MAX_NUMBER_FILES * MAX_UPLOAD_BYTES
    )
    assert largest < settings.REQUEST_MAX_BODY_BYTES <= largest + 2 * 1024 * 1024


def test_a_declared_length_over_the_bound_is_413_before_any_of_it_is_read(server) -> None:
    sock = connect(server.url)
    with sock:
        sock.sendall(
            b"POST /accounts/login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: %d\r\n\r\n" % (50 * LIMIT)
        )
        answer = read_answer(sock)  # not one byte of the body was sent
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"REQUEST_MAX_BODY_BYTES" in answer and b"Connection: close" in answer


def test_a_chunked_body_is_cut_at_the_bound_and_nothing_of_it_is_kept(server) -> None:
    sock = connect(server.url)
    chunk = b"x" * 65536
    sent = 0
    peak = 0
    with sock:
        sock.sendall(
            b"POST /push/1/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 16 * LIMIT:  # sixteen times the bound, if the server let it
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                peak = max(peak, spooled_bytes(server.pid))
        answer = read_answer(sock)
    assert sent < 16 * LIMIT  # the server closed the connection
    assert peak <= LIMIT + len(chunk) + 1024
    assert answer == b"" or answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    deadline = time.monotonic() + 5
    while spooled_bytes(server.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert spooled_bytes(server.pid) == 0
    # The server goes on answering, and a body within the bound reaches the application.
    small = httpx.post(f"{server.url}/accounts/login/", content=b"a=" + b"y" * (LIMIT // 2),
                       headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=10)  # fmt: skip
    assert small.status_code == 403  # Django's CSRF check: the application saw it
    assert httpx.get(f"{server.url}/accounts/login/", timeout=10).status_code == 200
