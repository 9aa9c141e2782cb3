"""A2UI surfaces in pages: the fragments the task page, the conversation and the inbox show,
the live fragment view, and the view that sends a Button's action.

Drawing is ``tasks_app/a2ui_render.py``; sending is ``services/a2ui_actions.py``.
"""

from __future__ import annotations

import copy
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString, mark_safe
from django.views.decorators.http import require_GET, require_POST

from tasks_app import access
from tasks_app.a2a import a2ui as protocol
from tasks_app.a2a.safejson import whole_number
from tasks_app.a2ui_render import render_surface
from tasks_app.access import Perm, get_task_for_user
from tasks_app.models import OperatorAction, RemoteTask, Surface
from tasks_app.rendering import markdown_budgeted
from tasks_app.services import a2ui_actions

SURFACES_ON_PAGE = 20
PLACES = ("task", "inbox")


def _surfaces(task: RemoteTask, *, with_deleted: bool = False) -> list[Surface]:
    qs = Surface.objects.filter(task=task).select_related("action_by").order_by("id")
    if not with_deleted:
        qs = qs.filter(deleted=False)
    return list(qs[:SURFACES_ON_PAGE])


def surfaces_html(request: HttpRequest, task: RemoteTask, place: str = "task") -> list[SafeString]:
    """The task's surfaces drawn for ``place`` (the task page or an inbox row)."""
    can_act = access.can(request.user, task.agent.project_id)["operate"]
    waiting = task.state in ("TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED")
    next_url = reverse("inbox") if place == "inbox" else reverse("task-detail", args=[task.pk])
    surfaces = _surfaces(task)
    last = last_actions(task) if surfaces else {}
    return [
        render_surface(
            s,
            task=task,
            request=request,
            place=place,
            interactive=waiting and task.abandoned_at is None,
            can_act=can_act,
            next_url=next_url,
            last_action=last.get(s.surface_id),
        )
        for s in surfaces
    ]


def last_actions(task: RemoteTask) -> dict[str, OperatorAction]:
    """The latest action per surface id (from the operator-action log, newest first)."""
    rows = (
        OperatorAction.objects.filter(task=task, action="a2ui-action")
        .select_related("actor")
        .order_by("-created_at", "-id")[:100]
    )
    out: dict[str, OperatorAction] = {}
    for row in rows:
        sid = row.payload.get("surface") if isinstance(row.payload, dict) else None
        if isinstance(sid, str):
            out.setdefault(sid, row)
    return out


def tasks_with_surfaces(task_pks: list[int]) -> set[int]:
    """Which of these tasks have a surface to show (one query for a page of rows)."""
    if not task_pks:
        return set()
    return set(
        Surface.objects.filter(task_id__in=task_pks, deleted=False)
        .values_list("task_id", flat=True)
        .distinct()
    )


def surfaces_block(request: HttpRequest, task: RemoteTask, place: str = "task") -> SafeString:
    return mark_safe("".join(surfaces_html(request, task, place)))  # each drawn and escaped


def surface_ids_in(message: Any) -> list[str]:
    """The surface ids the A2UI parts of a message name, in order, once each."""
    if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
        return []
    found: list[str] = []
    for part in message["parts"][:50]:
        for item in protocol.messages_in_part(part)[:200]:
            sid = protocol.surface_id_of(item)
            if sid is not None and sid not in found:
                found.append(sid)
    return found


def add_conversation_surfaces(task: RemoteTask, items: list[dict]) -> list[dict]:
    """Each conversation entry that carried A2UI gets the surfaces it named, drawn read-only
    in their current state (the latest message naming a surface only; the form to act on is
    in the progress section)."""
    named = [(item, surface_ids_in(item["message"])) for item in items]
    # The most recently named first, at most SURFACES_ON_PAGE, as in the progress section
    # (fifty drawn here as well made a task page of 15 s).
    wanted: list[str] = []
    for _, ids in reversed(named):
        wanted += [sid for sid in ids if sid not in wanted]
    wanted = wanted[:SURFACES_ON_PAGE]
    if not wanted:
        return items
    by_id = {
        s.surface_id: s
        for s in Surface.objects.filter(task=task, surface_id__in=wanted)
        .select_related("action_by")
        .order_by("id")
    }
    shown: set[str] = set()
    for item, ids in reversed(named):
        drawn = []
        for sid in ids:
            if sid in shown or sid not in by_id:
                continue
            shown.add(sid)
            drawn.append(
                render_surface(
                    by_id[sid], task=task, place=f"conv{item['m'].pk}", interactive=False
                )
            )
        item["surfaces"] = drawn
    return items


@login_required
@require_GET
@markdown_budgeted  # the agent's surfaces: a bounded cost per draw, as the task page's
def task_surfaces(request: HttpRequest, pk: int) -> HttpResponse:
    """The task's surfaces, server-drawn, for the page's script to swap in live."""
    task = get_task_for_user(request, pk)
    place = request.GET.get("place", "task")
    place = place if place in PLACES else "task"
    return HttpResponse(surfaces_block(request, task, place), content_type="text/html")


@login_required
@require_POST
def task_surface_act(request: HttpRequest, pk: int) -> HttpResponse:
    """A Button of a surface was pressed: send its action (or say why not), then go back."""
    task = get_task_for_user(request, pk, Perm.OPERATE)
    back = request.POST.get("next") or ""
    # A path of this site, nothing else (redirect() would also read other text as a view name).
    if not back.startswith("/") or not url_has_allowed_host_and_scheme(
        back, allowed_hosts={request.get_host()}
    ):
        back = reverse("task-detail", args=[task.pk])
    seq = whole_number(request.POST.get("seq", ""))
    surface_id = request.POST.get("surface", "")[:200]
    if seq is None:
        messages.error(request, "This form is incomplete; reload the page.")
        return HttpResponseRedirect(back)
    try:
        a2ui_actions.act(
            request.user, task, surface_id, seq, request.POST.get("source", ""), request.POST
        )
    except a2ui_actions.ActionRefused as exc:
        if exc.errors:
            # Drawn again with what was typed (a redirect, to the inbox say, would lose it);
            # the corrected form still goes back where the person came from.
            return _with_errors(request, task, surface_id, exc, back)
        messages.error(request, str(exc))
    except a2ui_actions.task_services.TaskActionError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Sent to the agent: {task.title or task}.")
    return HttpResponseRedirect(back)


def _with_errors(
    request: HttpRequest,
    task: RemoteTask,
    surface_id: str,
    exc: a2ui_actions.ActionRefused,
    back: str,
) -> HttpResponse:
    """The task page again, the refused form drawn with what was typed and each failing
    check next to its input (a page without the script, whose checks stop most of these)."""
    from tasks_app import views

    def draw() -> SafeString:
        out = []
        for surface in _surfaces(task):
            if surface.surface_id != surface_id:
                out.append(render_surface(surface, task=task, request=request, interactive=False))
                continue
            shown = copy.copy(surface)
            shown.data_model = exc.model
            out.append(
                render_surface(
                    shown,
                    task=task,
                    request=request,
                    next_url=back,
                    errors=exc.errors,
                )
            )
        return mark_safe("".join(out))  # each drawn and escaped

    messages.error(request, str(exc))
    return views._render_task_with(request, task, surfaces=draw)
