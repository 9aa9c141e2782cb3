"""The inbox: every task waiting on a person, oldest question first, with an answer form inline.

A task waits on a person while its state is ``input-required`` or ``auth-required`` and it is
neither abandoned, settled nor gone at the agent (an answer could never reach it: its page
offers refresh and abandon); only the agents of the person's projects count
(``access.readable_tasks``). A question that was answered but not yet taken up by the agent
still counts (the state has not moved), shown with who answered and when, without a form;
the browser can tell waiting from the task-list summaries alone (state and watcher status),
so the live badge and the server agree.

The navigation badge (``templatetags/inbox_tags.py``) comes from ``waiting_ids``: one indexed query
(the ``state`` index), at most ``COUNT_LIMIT`` + 1 ids; under the limit the ids go to the page
so that the badge's script knows which tasks it already counted.

The page is ordered by when the question was asked (``RemoteTask.asked_at``, stored by
``record()`` with the row that asked; the partial index ``inbox_order`` holds the waiting
tasks in that order), keyset paging on (asked_at, id).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import BooleanField, F, Func, OuterRef, QuerySet, Subquery, TextField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Length, Substr
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from tasks_app import access, answers, cursors, views_a2ui
from tasks_app.access import Perm, get_task_for_user
from tasks_app.middleware import form_removes_nul
from tasks_app.models import INTERRUPTED_STATES, ConversationMessage, RemoteTask, for_list
from tasks_app.rendering import markdown_budgeted

COUNT_LIMIT = 1000
PAGE_SIZE = 20
QUESTION_LINES = 4
QUESTION_CHARS = 400


# The states as literals, as the partial index ``inbox_order`` names them: SQLite uses a
# partial index only when the query's own terms show its condition, and a state list sent
# as parameters shows nothing (the inbox sorted every waiting task for each page).
assert all(state.replace("_", "").isalpha() for state in INTERRUPTED_STATES)
_WAITING_STATES = Func(
    F("state"),
    template=f"%(expressions)s IN ({', '.join(repr(s) for s in INTERRUPTED_STATES)})",
    output_field=BooleanField(),
)


def waiting(qs: QuerySet[RemoteTask]) -> QuerySet[RemoteTask]:
    """The tasks of ``qs`` that wait on a person (the rule in the module docstring)."""
    return qs.filter(
        _WAITING_STATES, abandoned_at__isnull=True, settled_at__isnull=True, gone_at__isnull=True
    )


def waiting_ids(user: Any) -> list[int]:
    """Ids of the person's waiting tasks, at most ``COUNT_LIMIT`` + 1 (more means "1000+")."""
    return list(
        waiting(access.readable_tasks(user))
        .order_by()
        .values_list("pk", flat=True)[: COUNT_LIMIT + 1]
    )


def question_lines(message: Any) -> str:
    """The first lines of the question's text parts (plain text: the template escapes it)."""
    if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
        return ""
    lines: list[str] = []
    for part in message["parts"]:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            lines += [line.strip() for line in part["text"].splitlines() if line.strip()]
        if len(lines) >= QUESTION_LINES:
            break
    text = "\n".join(lines[:QUESTION_LINES])
    more = len(lines) > QUESTION_LINES or len(text) > QUESTION_CHARS
    return text[:QUESTION_CHARS] + ("…" if more else "")


def row_context(
    request: HttpRequest, task: RemoteTask, form: Any = None, has_surfaces: bool = True
) -> dict[str, Any]:
    """One waiting task as the inbox shows it (the form only for people who may operate).

    ``has_surfaces`` False (the page looked them up for all its rows at once) skips the
    task's A2UI surfaces query."""
    can = access.can(request.user, task.agent.project_id)
    is_waiting = (
        task.state in INTERRUPTED_STATES and task.abandoned_at is None and task.settled_at is None
    )
    answered = (
        bool(task.asked_seq)
        and task.answered_seq >= task.asked_seq
        and task.answered_at is not None
    )
    too_long = getattr(task, "question_chars", None)  # see _questions: answered on its page
    if form is None and can["operate"] and is_waiting and not answered and not too_long:
        form = answers.answer_form(task, prefix=f"t{task.pk}")
    refusal, kept = _refused(form) if not is_waiting else ("", "")
    return {
        "task": task,
        "asked_at": task.asked_at or task.status_timestamp or task.created_at,
        "question": question_lines(task.status_message),
        "too_long": too_long,
        "waiting": is_waiting,
        "answered": answered,
        "can": can,
        "form": form if can["operate"] and is_waiting else None,
        "refusal": refusal,
        "kept": kept,
        "answer_action": reverse("inbox-answer", args=[task.pk]),
        # The row of an answer refused: the page that comes back brings it into view
        # (static/dashboard/forms.js); it opened at the top, the error maybe far below.
        "refused": bool(refusal or getattr(form, "notice", ""))
        or (form is not None and form.is_bound and bool(form.errors)),
        "answer_form_id": f"answer-form-{task.pk}",
        # The agent's A2UI forms, to fill in here (drawn by tasks_app/a2ui_render.py).
        "surfaces": (lambda: views_a2ui.surfaces_block(request, task, "inbox"))
        if is_waiting and has_surfaces
        else "",
    }


def _refused(form: Any) -> tuple[str, str]:
    """An answer refused because its task stopped waiting: why (who answered, when), and the
    free text typed, to copy. The row shows no form then, and its errors went unseen."""
    if form is None or not form.is_bound or not form.errors:
        return "", ""
    said = [str(e) for errors in form.errors.values() for e in errors]
    typed = form.data.get(form.add_prefix("text"), "") if "text" in form.fields else ""
    return " ".join(said), str(typed)


# A question (the task's status message) is read whole for the inbox up to this many
# characters of its JSON; a longer one as the head of its first text part, cut by the
# database, and answered on the task page. A status message goes up to WATCH_MAX_EVENT_BYTES:
# twenty waiting tasks of an agent asking 8 MB questions made each view of the inbox read
# 160 MB.
INBOX_QUESTION_CHARS = 256 * 1024


def _questions(tasks: list[RemoteTask]) -> None:
    """Give each of ``tasks`` (read without ``status_message``) its question, or, for one too
    long for the inbox, ``question_chars`` and the head of its text as a stand-in."""
    short = [t.pk for t in tasks if (t.question_chars or 0) <= INBOX_QUESTION_CHARS]
    whole = dict(RemoteTask.objects.filter(pk__in=short).values_list("pk", "status_message"))
    heads = dict(
        RemoteTask.objects.filter(pk__in=[t.pk for t in tasks if t.pk not in whole])
        .annotate(head=Substr(KT("status_message__parts__0__text"), 1, QUESTION_CHARS * 2))
        .values_list("pk", "head")
    )
    for task in tasks:
        if task.pk in whole:
            task.status_message = whole[task.pk]
            task.question_chars = None
        else:
            head = heads.get(task.pk)
            task.status_message = {"parts": [{"text": head}]} if head else None


def _page(
    request: HttpRequest, forms: dict[int, Any] | None = None, extra: RemoteTask | None = None
) -> dict[str, Any]:
    forms = forms or {}
    # ``asked_at`` is stored when the question is recorded; the partial index ``inbox_order``
    # holds exactly the waiting tasks in this order, so a page costs its own rows.
    qs = waiting(access.readable_tasks(request.user))
    cursor_text = request.GET.get("cursor", "")
    cursor = cursors.decode(cursor_text) if cursor_text else None
    cursor_broken = bool(cursor_text) and cursor is None
    if cursor_broken:
        qs = qs.none()  # as the audit page: its rows would pass for the page the link meant
    elif cursor:
        qs = qs.filter(cursors.after("asked_at", *cursor, descending=False))
    # The order is found on two narrow columns, then the page's rows are read whole.
    keys = list(qs.order_by("asked_at", "pk").values_list("pk", flat=True)[: PAGE_SIZE + 1])
    has_next = len(keys) > PAGE_SIZE
    keys = keys[:PAGE_SIZE]
    # The agent's JSON is not read with the rows; the questions are read apart (_questions).
    rows = (
        for_list(RemoteTask.objects.select_related("agent", "answered_by"))
        .annotate(question_chars=Length(Cast("status_message", TextField())))
        .in_bulk(keys)
    )
    tasks = [rows[pk] for pk in keys if pk in rows]
    _questions(tasks)
    if extra is not None and all(t.pk != extra.pk for t in tasks):
        tasks.insert(0, extra)  # the task whose answer was refused, wherever it is in the list
    ids = waiting_ids(request.user)
    with_surfaces = views_a2ui.tasks_with_surfaces([t.pk for t in tasks])
    answered = answers_of(tasks)  # one read for the page, not one per row
    for task in tasks:
        task.answer_message = answered.get(task.pk)  # type: ignore[attr-defined]
    next_url = ""
    if has_next and tasks and tasks[-1].asked_at is not None:
        last = tasks[-1]
        next_url = "?" + urlencode({"cursor": cursors.encode(last.asked_at, last.pk)})
    return {
        "rows": [
            row_context(request, t, forms.get(t.pk), has_surfaces=t.pk in with_surfaces)
            for t in tasks
        ],
        "count": min(len(ids), COUNT_LIMIT),
        "count_capped": len(ids) > COUNT_LIMIT,
        "count_limit": COUNT_LIMIT,
        "next_url": next_url,
        "first_url": reverse("inbox") if cursor_text else "",
        "cursor_broken": cursor_broken,
        # New waiting tasks are the newest questions: they belong on the last page.
        "live_insert": not has_next and not cursor_broken,
        "now": timezone.now(),
    }


@login_required
@require_GET
@markdown_budgeted
def inbox(request: HttpRequest) -> HttpResponse:
    context = _page(request)
    return render(
        request, "tasks_app/inbox.html", context, status=400 if context["cursor_broken"] else 200
    )


@login_required
@require_GET
@markdown_budgeted
def inbox_row(request: HttpRequest, pk: int) -> HttpResponse:
    """One task as an inbox row (server-rendered, for live inserts): its question read as
    the page reads it (``_questions``), not whole (it goes up to WATCH_MAX_EVENT_BYTES, and
    every open inbox asks for the row of each task that starts waiting)."""
    task = get_task_for_user(
        request, pk, related=("agent", "answered_by"), unread=("status_message",)
    )
    task.question_chars = (  # type: ignore[attr-defined]
        RemoteTask.objects.filter(pk=pk)
        .annotate(chars=Length(Cast("status_message", TextField())))
        .values_list("chars", flat=True)
        .first()
    )
    _questions([task])
    return render(request, "tasks_app/_inbox_row.html", {"row": row_context(request, task)})


@form_removes_nul
@login_required
@require_POST
@markdown_budgeted
def inbox_answer(request: HttpRequest, pk: int) -> HttpResponse:
    """Answer from the inbox: back to the inbox when sent, else the inbox with the errors."""
    task = get_task_for_user(request, pk, Perm.OPERATE, related=("agent", "answered_by"))
    form = answers.answer_form(task, request.POST, request.FILES, prefix=f"t{task.pk}")
    sent, form = answers.submit(request, task, form)
    if sent:
        messages.success(request, f"Answer sent: {task.title or task}.")
        return redirect("inbox")
    task = RemoteTask.objects.select_related("agent", "answered_by").get(pk=task.pk)
    context = _page(request, {task.pk: form}, extra=task)
    return render(request, "tasks_app/inbox.html", context, status=400)


def answers_of(tasks: list[RemoteTask]) -> dict[int, ConversationMessage]:
    """Each answered task's answer message (the last message of ours after the question:
    an answer the agent refused is followed by the one given again), for a page of tasks in
    two queries whatever its length."""
    answered = [t for t in tasks if t.answered_at]
    if not answered:
        return {}
    first = (
        ConversationMessage.objects.filter(
            task_id=OuterRef("pk"), role="ROLE_USER", seq__gt=OuterRef("answered_seq")
        )
        .order_by("-seq", "-id")
        .values("pk")[:1]
    )
    ids = dict(
        RemoteTask.objects.filter(pk__in=[t.pk for t in answered])
        .annotate(answer_id=Subquery(first))
        .values_list("pk", "answer_id")
    )
    found = ConversationMessage.objects.in_bulk([i for i in ids.values() if i is not None])
    return {pk: found[i] for pk, i in ids.items() if i in found}
