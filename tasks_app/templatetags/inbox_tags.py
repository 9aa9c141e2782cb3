"""The inbox badge in the navigation, and the record of an answer, for any template.

A template tag rather than a context processor: only pages that show the navigation pay for
the count, and a page rendered without a request (the 500 page) shows no badge at all.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.db import DatabaseError
from django.utils import timezone

from tasks_app.inbox import COUNT_LIMIT, answers_of, waiting_ids
from tasks_app.models import RemoteTask
from tasks_app.rendering import message_html

register = template.Library()


@register.inclusion_tag("tasks_app/_inbox_badge.html", takes_context=True)
def inbox_badge(context: template.Context) -> dict[str, Any]:
    """The count of tasks waiting on this person, and (under the cap) which ones."""
    request = context.get("request")
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"show": False}
    try:
        ids = waiting_ids(user)
    except DatabaseError:
        return {"show": True, "unknown": True, "current": _current(request)}
    capped = len(ids) > COUNT_LIMIT
    return {
        "show": True,
        "count": min(len(ids), COUNT_LIMIT),
        "capped": capped,
        "limit": COUNT_LIMIT,
        "ids": "" if capped else ",".join(map(str, ids)),
        "rendered_at": timezone.now().isoformat(),
        "current": _current(request),
    }


def _current(request: Any) -> bool:
    match = getattr(request, "resolver_match", None)
    return bool(match and match.url_name == "inbox")


@register.inclusion_tag("tasks_app/_answer_record.html")
def answer_record(task: RemoteTask, in_list: bool = False) -> dict[str, Any]:
    """The last answer sent on this task, read-only: who, when, and the message itself.

    ``in_list``: one of several on a page (the inbox), whose answers were read for the
    whole page at once (:func:`answers_of`)."""
    if not task.answered_at:
        return {"task": task}
    if hasattr(task, "answer_message"):
        message = task.answer_message
    else:
        message = answers_of([task]).get(task.pk)
    return {
        "task": task,
        "dom_id": f"answer-record-{task.pk}" if in_list else "answer-record",
        "answered": True,
        "by": task.answered_by.get_username()
        if task.answered_by_id and task.answered_by
        else "a command-line user",
        "html": message_html(message.message) if message else "",
        "current": task.answered_seq >= task.asked_seq,
        # Refused by the agent (or never got to it): its question is open again.
        "failed": task.answer_failed_at is not None and task.answered_seq < task.asked_seq,
    }
