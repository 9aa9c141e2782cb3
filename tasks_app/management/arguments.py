"""Argument types for the management commands: numbers within the bounds they are used in.

A plain ``type=int`` took anything: ``tasks list --limit -3`` ended in a ValueError,
``prune --batch 99999999999999999999`` in PostgreSQL's "bigint out of range" and ``up --port
99999`` in an OverflowError, each a traceback. A type from here refuses such a value the way
argparse refuses any: ``manage.py tasks list: error: argument --limit: …`` in one sentence,
exit 2, before the command starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from django.core.management.base import CommandError

from tasks_app.runtime.logs import one_line
from tasks_app.runtime.net import redact_url


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An int from ``low`` to ``high`` (both included)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"a whole number is needed, not {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"from {low:,} to {high:,}, not {text.strip()}")
        return value

    return parse


def float_between(
    low: float, high: float, *, more_than_low: bool = False
) -> Callable[[str], float]:
    """A finite float from ``low`` (excluded when ``more_than_low``) to ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number is needed, not {text!r}") from None
        above_low = value > low if more_than_low else value >= low
        if not math.isfinite(value) or not above_low or value > high:
            span = f"more than {low:,g} and at most" if more_than_low else f"from {low:,g} to"
            raise argparse.ArgumentTypeError(f"{span} {high:,g}, not {text.strip()}")
        return value

    return parse


def shown(ref: str) -> str:
    """A reference (an id, a name, a URL) as an error message repeats it: a URL without its
    password or query values (``No agent 'http://u:secret@…'`` printed the password), and at
    most 200 characters, quoted."""
    text = redact_url(ref) if "://" in ref else ref
    # Quoted as typed, not as Python writes it (a quote in a name came back backslashed);
    # a line end, a tab or what drives a terminal is escaped (``one_line``).
    return "'" + one_line(text if len(text) <= 200 else text[:199] + "…") + "'"


def require_reference(ref: str, what: str) -> None:
    """An empty reference names nothing: it matched the one task with no remote id yet (a
    send not answered), and ``tasks cancel ''`` canceled it."""
    if not ref.strip():
        raise CommandError(f"Name the {what}: an empty reference names none.")
