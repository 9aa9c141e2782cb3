"""Keyset-paging cursors: (a timestamp, an id) as an opaque URL-safe token.

The task list, the inbox and the operator-action log page by (time, id): a page starts
after the last row of the one before, so paging costs the page, never an OFFSET. A cursor
that does not decode (edited by hand, cut short) is None: the page answers 400, lists
nothing, and links to its first page (rows listed under a broken link would pass for the
page it meant).
"""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime

from django.db.models import Q
from django.utils import timezone
from django.utils.dateparse import parse_datetime


def encode(moment: datetime, pk: int) -> str:
    return base64.urlsafe_b64encode(f"{moment.isoformat()}|{pk}".encode()).decode().rstrip("=")


def decode(cursor: str) -> tuple[datetime, int] | None:
    """(moment, pk), or None for anything that is not a cursor this module wrote."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, pk = text.rsplit("|", 1)
        moment = parse_datetime(stamp)
        if moment is None or not timezone.is_aware(moment):
            return None
        # Compared in UTC by the database: a moment with none (year 1 at +05:00) is no cursor.
        moment.astimezone(UTC)
        return moment, int(pk)
    except (ValueError, OverflowError, binascii.Error, UnicodeDecodeError):
        return None


def after(field: str, moment: datetime, pk: int, *, descending: bool) -> Q:
    """The rows strictly after the cursor (``moment``, ``pk``) in the order (``field``, pk).

    Its first condition is a plain range on ``field``, which an index on (``field``, id)
    seeks to; the rest steps over the rows tied with the cursor. Written only as "earlier,
    or tied and earlier by id", the databases walked that index from the first row down to
    the cursor: 31 ms for an audit page 25,000 actions deep on SQLite, 1.7 ms with the range.
    """
    past, bound = ("lt", "lte") if descending else ("gt", "gte")
    return Q(**{f"{field}__{bound}": moment}) & (
        Q(**{f"{field}__{past}": moment}) | Q(**{f"pk__{past}": pk})
    )
