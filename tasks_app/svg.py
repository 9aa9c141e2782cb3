"""A server-rendered SVG picture of a task's states over time, from its log."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from tasks_app.models import TERMINAL_STATES

WIDTH = 800
BAR_Y = 22
BAR_H = 22
HEIGHT = 66
MAX_TICKS = 400


END_MARK = 36  # room at the right for the final state of an ended task


def state_short(state: str) -> str:
    if not state:
        return "sending"
    return state.removeprefix("TASK_STATE_").lower().replace("_", "-")


def _fmt_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def timeline_svg(
    events: Sequence[tuple[int, datetime, str]],
    *,
    now: datetime | None = None,
    ended: bool | None = None,
) -> SafeString:
    """``events``: (seq, received_at, state_after) in seq order.

    Segments are runs of equal state; the last one runs to ``now`` unless the
    task ended. Every entry gets a tick (thinned out beyond a few hundred).
    """
    if not events:
        return mark_safe(
            f'<svg class="timeline" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
            'aria-label="No events yet"><text x="8" y="36" class="tl-label">No events yet</text></svg>'
        )
    now = now or timezone.now()
    start = events[0][1]
    last_state = events[-1][2]
    ended = ended or last_state in TERMINAL_STATES
    end = events[-1][1] if ended else max(now, events[-1][1])
    span = max((end - start).total_seconds(), 0.001)
    # An ended task's last state has no duration: it gets a fixed mark at the end.
    usable = WIDTH - 8 - (END_MARK if ended else 0)

    def x_of(t: datetime) -> float:
        return round(4 + usable * ((t - start).total_seconds() / span), 2)

    segments: list[tuple[str, datetime, datetime]] = []
    for _seq, at, state in events:
        if segments and segments[-1][0] == state:
            continue
        if segments:
            segments[-1] = (segments[-1][0], segments[-1][1], at)
        segments.append((state, at, at))
    segments[-1] = (segments[-1][0], segments[-1][1], end)

    out: list[str] = [
        f'<svg class="timeline" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'aria-label="{escape(_summary(segments))}">'
    ]
    for i, (state, a, b) in enumerate(segments):
        x1, x2 = x_of(a), x_of(b)
        if ended and i == len(segments) - 1:
            x2 = x1 + END_MARK
        width = max(x2 - x1, 2)
        short = state_short(state)
        seconds = (b - a).total_seconds()
        out.append(
            f'<rect class="tl-seg st-{escape(short)}" x="{x1}" y="{BAR_Y}" width="{width:.2f}" '
            f'height="{BAR_H}" rx="3"><title>{escape(short)}: {escape(_fmt_duration(seconds))} '
            f"from {escape(a.strftime('%H:%M:%S %Z'))}</title></rect>"
        )
        if ended and i == len(segments) - 1:
            out.append(
                f'<text class="tl-label" x="{WIDTH - 4}" y="{BAR_Y - 6}" text-anchor="end">{escape(short)}</text>'
            )
        elif width > 60:
            out.append(
                f'<text class="tl-label" x="{x1 + 4}" y="{BAR_Y - 6}">{escape(short)}</text>'
            )
    step = max(1, len(events) // MAX_TICKS)
    for i in range(0, len(events), step):
        seq, at, _state = events[i]
        x = x_of(at)
        out.append(
            f'<line class="tl-tick" x1="{x}" x2="{x}" y1="{BAR_Y + BAR_H + 2}" y2="{BAR_Y + BAR_H + 8}">'
            f"<title>#{seq} at {escape(at.strftime('%H:%M:%S.%f')[:-3])} {escape(at.tzname() or '')}</title>"
            "</line>"
        )
    out.append(
        f'<text class="tl-axis" x="4" y="{HEIGHT - 2}">{escape(start.strftime("%H:%M:%S %Z"))}</text>'
        f'<text class="tl-axis" x="{WIDTH - 4}" y="{HEIGHT - 2}" text-anchor="end">'
        f"+{escape(_fmt_duration(span))}</text>"
    )
    out.append("</svg>")
    return mark_safe("".join(out))  # every interpolated string escaped


# States a timeline's label names, at most (its picture shows the rest).
SUMMARY_SEGMENTS = 40


def _summary(segments: list[tuple[str, datetime, datetime]]) -> str:
    named = ", ".join(
        f"{state_short(s)} {_fmt_duration((b - a).total_seconds())}"
        for s, a, b in segments[:SUMMARY_SEGMENTS]
    )
    more = len(segments) - SUMMARY_SEGMENTS
    return f"States over time: {named}" + (f", and {more} more changes" if more > 0 else "")
