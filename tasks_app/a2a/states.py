"""The task state machine's sets and rules, and small readers of A2A content.

Pure functions over plain ProtoJSON values. The one fold of events into a task
lives in the mirror (``tasks_app.services.record``), which applies these rules;
this module only says which states are terminal, interrupted or active, and
which transitions are illegal (leaving a terminal state, an UNSPECIFIED or
unknown state).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from .types import (
    ALL_STATES,
    STATE_AUTH_REQUIRED,
    STATE_CANCELED,
    STATE_COMPLETED,
    STATE_FAILED,
    STATE_INPUT_REQUIRED,
    STATE_REJECTED,
    STATE_SUBMITTED,
    STATE_UNSPECIFIED,
    STATE_WORKING,
)

TERMINAL_STATES = frozenset({STATE_COMPLETED, STATE_FAILED, STATE_CANCELED, STATE_REJECTED})
INTERRUPTED_STATES = frozenset({STATE_INPUT_REQUIRED, STATE_AUTH_REQUIRED})
ACTIVE_STATES = frozenset({STATE_SUBMITTED, STATE_WORKING})


def is_terminal(state: str | None) -> bool:
    return state in TERMINAL_STATES


def is_interrupted(state: str | None) -> bool:
    return state in INTERRUPTED_STATES


def is_active(state: str | None) -> bool:
    return state in ACTIVE_STATES


def transition_problem(old: str | None, new: str | None) -> str | None:
    """Describe what is wrong with moving from ``old`` to ``new`` (``None`` if fine).

    Reports, never raises: the caller still renders ``new``. ``old`` being
    ``None`` means "no state known yet".
    """
    if not new or new == STATE_UNSPECIFIED:
        return "task state is TASK_STATE_UNSPECIFIED (agent sent no state)"
    if new not in ALL_STATES:
        return f"unknown task state {new!r}"
    if old in TERMINAL_STATES and new != old:
        return f"illegal transition {old} -> {new}: terminal tasks are immutable"
    return None


def artifact_text(artifact: dict[str, Any], sep: str = "") -> str:
    """Concatenated text parts of an artifact (or message)."""
    return sep.join(
        p["text"] for p in artifact.get("parts") or [] if isinstance(p.get("text"), str)
    )


def message_text(message: dict[str, Any] | None, sep: str = "\n") -> str:
    return artifact_text(message or {}, sep)


def parse_timestamp(value: Any) -> datetime | None:
    """RFC 3339 with or without fractional seconds; ``None`` when absent/unparsable."""
    if not isinstance(value, str) or not value:
        return None
    text = value.strip().replace("z", "Z")
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    # fromisoformat (3.11) accepts 1-6 fractional digits; trim nanoseconds.
    if "." in text:
        head, _, rest = text.partition(".")
        digits = "".join(ch for ch in rest if ch.isdigit())
        tz = rest[len(digits) :]
        text = f"{head}.{digits[:6].ljust(6, '0')}{tz}"
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)
