"""A bound on the request bodies daphne takes in, before any of it is stored.

Daphne's HTTP is Twisted's: Twisted reads a request's whole body into a temporary file
(over 100 kB) before daphne hands the request to the application, and nothing bounds it.
So every limit of ours (Django's on fields and files, the webhook's on a push body) came
after the bytes were already on this machine's disk: anyone who can reach the site, logged
in or not, could fill the disk with one POST. Behind a proxy its own limit applies first
(docs/deployment.md); this one holds without one.

A body whose declared length is over ``REQUEST_MAX_BODY_BYTES`` is answered 413 at once,
before any of it is read; a body without a length (chunked) is counted as it arrives and
answered 413 when it passes the bound. Either way the connection is closed, nothing more is
kept, and the application never sees the request.
"""

from __future__ import annotations

import io
import logging
from typing import Any

logger = logging.getLogger(__name__)

_BODY = b"The request body is larger than this server takes (REQUEST_MAX_BODY_BYTES).\n"
REFUSAL = (
    b"HTTP/1.1 413 Content Too Large\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: %d\r\n"
    b"Connection: close\r\n\r\n" % len(_BODY)
) + _BODY


def install(limit: int) -> bool:
    """Make daphne's requests refuse bodies over ``limit`` bytes; False without daphne."""
    try:
        from daphne import http_protocol
    except ImportError:  # another ASGI server
        return False
    base = getattr(http_protocol.WebRequest, "_unbounded", http_protocol.WebRequest)

    class BoundedWebRequest(base):  # type: ignore[misc, valid-type]
        """Daphne's request, counting the body as Twisted receives it."""

        _unbounded = base
        max_body = limit

        def gotLength(self, length: int | None) -> None:
            self._body_bytes = 0
            self._refused = False
            if length is not None and length > self.max_body:
                self._refuse(f"a declared length of {length:,} bytes")
                return
            super().gotLength(length)

        def handleContentChunk(self, data: bytes) -> None:
            if self._refused:
                return
            self._body_bytes += len(data)
            if self._body_bytes > self.max_body:
                self._refuse(f"over {self.max_body:,} bytes sent without a length")
                return
            super().handleContentChunk(data)

        def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
            if getattr(self, "_refused", False):
                return  # answered already; the application never sees it
            super().requestReceived(command, path, version)

        def _refuse(self, what: str) -> None:
            self._refused = True
            self.content: Any = io.BytesIO()  # nothing of the body is kept
            logger.warning(
                "Refused a request body (%s; REQUEST_MAX_BODY_BYTES is %d)", what, self.max_body
            )
            transport = self.channel.transport
            transport.write(REFUSAL)
            transport.loseConnection()

    http_protocol.WebRequest = BoundedWebRequest  # type: ignore[misc]
    return True
