"""The auditor's pages: the operator-action log (page and CSV) and a task's history export.

Who may: *audit* (auditors, superusers; see ``tasks_app.access``). The log shows the
actions on the agents and tasks of the projects a person audits (rows on no agent or
task only to superusers, see ``tasks_app.actionlog``); someone who audits nowhere gets
a 403 with a refusal row. A task export needs *read* on the task (else 404, its
existence is not revealed) and *audit* in its project (else 403).

Exports stream from the database in keyset batches (``tasks_app.exports``): memory stays
the size of one batch, whatever the size of the log.
"""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET

from tasks_app import access, actionlog, cursors, exports
from tasks_app.access import Perm, get_task_for_user

TASK_FORMATS = {
    "json": ("application/json", "json"),
    "jsonl": ("application/x-ndjson", "jsonl"),
}
FILTER_KEYS = ("person", "action", "project", "agent", "since", "until")


def _visible_or_refuse(request: HttpRequest):
    qs = actionlog.visible_actions(request.user)
    if qs is None:
        raise access.refuse(request.user, Perm.AUDIT, what=access.describe(request))
    return qs


def _stream(
    request: HttpRequest, chunks, content_type: str, filename: str
) -> StreamingHttpResponse:
    body = exports.as_async(chunks) if isinstance(request, ASGIRequest) else chunks
    response = StreamingHttpResponse(body, content_type=content_type)
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["X-Content-Type-Options"] = "nosniff"
    response["Cache-Control"] = "private, no-store"
    return response


@login_required
@require_GET
def audit_log(request: HttpRequest) -> HttpResponse:
    """Every operator action the person may audit, newest first, filtered by the URL."""
    visible = _visible_or_refuse(request)
    form = actionlog.ActionFilterForm(request.GET or None, user=request.user)
    filters = {k: request.GET[k] for k in FILTER_KEYS if request.GET.get(k)}
    cursor_text = request.GET.get("cursor", "")
    cursor = cursors.decode(cursor_text) if cursor_text else None
    cursor_broken = bool(cursor_text) and cursor is None
    valid = not form.is_bound or form.is_valid()
    rows: list = []
    next_url = ""
    if valid and not cursor_broken:
        data = form.cleaned_data if form.is_bound else {}
        result = actionlog.page(actionlog.apply_filters(visible, data), cursor)
        rows = [
            {"a": row, "details": actionlog.describe_payload(row.payload)} for row in result.rows
        ]
        if result.next_cursor:
            next_url = "?" + urlencode({**filters, "cursor": result.next_cursor})
    context = {
        "form": form,
        "rows": rows,
        "valid": valid,
        "cursor_broken": cursor_broken,
        "next_url": next_url,
        "first_url": ("?" + urlencode(filters)) if cursor_text else "",
        "csv_url": "?" + urlencode(filters) if filters else "",
        "now": timezone.now(),
    }
    return render(
        request, "tasks_app/audit.html", context, status=200 if valid and not cursor_broken else 400
    )


@login_required
@require_GET
def audit_csv(request: HttpRequest) -> HttpResponse:
    """The same rows as the page (same filters), as CSV, streamed."""
    visible = _visible_or_refuse(request)
    form = actionlog.ActionFilterForm(request.GET or None, user=request.user)
    if form.is_bound and not form.is_valid():
        problems = "; ".join(f"{form.fields[k].label if k in form.fields else k}: {' '.join(v)}"
                             for k, v in form.errors.items())  # fmt: skip
        return HttpResponseBadRequest(
            f"Bad filter: {problems}", content_type="text/plain; charset=utf-8"
        )
    data = form.cleaned_data if form.is_bound else {}
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    return _stream(request, exports.csv_chunks(actionlog.apply_filters(visible, data)),
                   "text/csv; charset=utf-8", f"operator-actions-{stamp}.csv")  # fmt: skip


@login_required
@require_GET
def task_export(request: HttpRequest, pk: int) -> HttpResponse:
    """A task's whole history: ``?format=json`` (one document, the default) or ``jsonl``."""
    task = get_task_for_user(request, pk, Perm.AUDIT, related=("agent__project", "started_by"))
    fmt = request.GET.get("format", "json")
    if fmt not in TASK_FORMATS:
        return HttpResponseBadRequest(
            "format must be json or jsonl", content_type="text/plain; charset=utf-8"
        )
    content_type, extension = TASK_FORMATS[fmt]
    return _stream(
        request, exports.task_chunks(task, fmt), content_type, f"task-{task.pk}.{extension}"
    )
