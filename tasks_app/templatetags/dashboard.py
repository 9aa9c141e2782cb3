"""Small template helpers. Agent content is rendered only through tasks_app.rendering."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import template
from django.utils import timezone
from django.utils.html import format_html

from tasks_app.models import STATE_CHOICES
from tasks_app.rendering import markdown_html, pretty_json
from tasks_app.svg import state_short as _state_short

register = template.Library()
_LABELS = dict(STATE_CHOICES)


# How an exchange without a state is called (the overview's columns say the same): "failed"
# beside a task that failed at the agent read as the agent's failure.
PHASE_LABELS = {
    "sending": "sending",
    "failed": "send failed",
    "message": "message reply",
    "task": "no state yet",
}


@register.filter
def state_short(state: str) -> str:
    return _state_short(state or "")


@register.filter
def state_label(state: str) -> str:
    return _LABELS.get(state or "", state) or "unknown"


@register.simple_tag
def state_badge(task: Any) -> str:
    """A badge for a task (its state, or its phase before the agent named a state)."""
    state = getattr(task, "state", "") or ""
    if state:
        short, label = _state_short(state), _LABELS.get(state, state)
    else:
        phase = getattr(task, "phase", "")
        short = f"phase-{phase}"
        label = PHASE_LABELS.get(phase, phase or "unknown")
    return format_html('<span class="badge st-{}" data-state="{}">{}</span>', short, state, label)


# What a watcher status is called on the page, which a watcher's note may begin with too.
_STATUS_WORDS = {"parked": "needs attention", "gone": "gone at the agent"}


@register.filter
def status_words(status: str) -> str:
    """A watcher status as the page calls it ("parked" is "needs attention")."""
    return _STATUS_WORDS.get(status, status)


@register.filter
def note_after_status(note: str, status: str) -> str:
    """A watcher's note without the words its status already shows ("Needs attention:
    needs attention: over its storage budget" said them twice)."""
    words = _STATUS_WORDS.get(status)
    if not note or not words or not note.lower().startswith(words):
        return note
    rest = note[len(words) :].lstrip(" :")
    return rest[:1].upper() + rest[1:] if rest else ""


@register.filter
def pretty(value: Any) -> str:
    return pretty_json(value)


@register.filter
def markdown(value: Any) -> str:
    return markdown_html(str(value or ""))


@register.filter
def get_item(mapping: Any, key: Any) -> Any:
    try:
        return mapping.get(key)
    except AttributeError:
        return None


@register.filter
def full_time(value: datetime | None) -> str:
    """Date, time to the millisecond and time zone: ``2026-11-30 12:54:20.123 UTC``."""
    if value is None:
        return ""
    local = timezone.localtime(value)
    return f"{local:%Y-%m-%d %H:%M:%S}.{local.microsecond // 1000:03d} {local.tzname()}"
