"""Pages of the dashboard. Views read the mirror and call services; they never write models."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.db.models import Count, F, Min, Q, QuerySet, TextField
from django.db.models.functions import Cast, Length, Substr
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseRedirect,
    JsonResponse,
    StreamingHttpResponse,
)
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.debug import sensitive_post_parameters
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from tasks_app import (
    access,
    answers,
    crypto,
    cursors,
    exports,
    inbox,
    kept_uploads,
    outbound,
    rendering,
    upload_budget,
    views_a2ui,
)
from tasks_app.a2a import safejson, validate_card
from tasks_app.a2a.card import registration_url
from tasks_app.access import Perm, get_agent_for_user, get_task_for_user
from tasks_app.forms import (
    AgentAddForm,
    AgentRenameForm,
    CancelForm,
    CredentialsForm,
    EventFilterForm,
    StartTaskForm,
    TaskFilterForm,
)
from tasks_app.middleware import form_removes_nul
from tasks_app.models import (
    AGENT_LIST_DEFERRED,
    INTERRUPTED_STATES,
    STATE_CHOICES,
    TERMINAL_STATES,
    Agent,
    Artifact,
    ConversationMessage,
    ImportJob,
    RemoteTask,
    TaskEvent,
    for_list,
)
from tasks_app.previews import (
    artifact_chunks,
    artifact_chunks_async,
    artifact_is_text,
    artifact_preview,
    conversation_messages,
    cut_message_html,
    raw_preview,
    with_raw_preview,
)
from tasks_app.rendering import (
    decode_raw,
    download_content_type,
    markdown_budget,
    markdown_budgeted,
    message_html,
    pretty_json,
    safe_filename,
)
from tasks_app.services import agents as agent_services
from tasks_app.services import audit
from tasks_app.services import imports as import_services
from tasks_app.services import tasks as task_services
from tasks_app.services.record import STORED_ONCE, references_in, task_summary
from tasks_app.svg import timeline_svg
from tasks_app.templatetags.dashboard import PHASE_LABELS

log = logging.getLogger(__name__)

PAGE_SIZE = 50
COUNT_LIMIT = 1000
EVENTS_ON_PAGE = 100  # a page of the full log
EVENTS_ON_TASK_PAGE = 100  # the newest entries under the task; the rest is a link away
MESSAGES_ON_PAGE = 100
STATE_LABELS = dict(STATE_CHOICES)
WATCHER_STATUSES = [s for s, _ in RemoteTask.WatcherStatus.choices]


# Overview ----------------------------------------------------------------------------------


def _overview_column(state: str, phase: str) -> str:
    return state or f"phase:{phase}"


def _overview_context(user) -> dict:
    agents = list(access.readable_agents(user).defer(*AGENT_LIST_DEFERRED))
    tasks = access.readable_tasks(user)
    by_agent: dict[int, dict[str, int]] = {}
    totals: dict[str, int] = {}
    for row in tasks.values("agent_id", "state", "phase").annotate(n=Count("id")).order_by():
        column = _overview_column(row["state"], row["phase"])
        counts = by_agent.setdefault(row["agent_id"], {})
        counts[column] = counts.get(column, 0) + row["n"]
        totals[column] = totals.get(column, 0) + row["n"]
    # Exchanges without a task state are counted by how far they got (phase), not as
    # "unknown", in the words of their badges.
    states = [f"phase:{p}" for p in PHASE_LABELS if totals.get(f"phase:{p}")]
    states += [s for s, _ in STATE_CHOICES if s and totals.get(s)]
    # A retired agent stays for the tasks it left behind, and only if it left some.
    agents = [a for a in agents if a.retired_at is None or a.pk in by_agent]
    rows = []
    for agent in agents:
        counts = by_agent.get(agent.pk, {})
        rows.append(
            {
                "agent": agent,
                "counts": [counts.get(s, 0) for s in states],
                "total": sum(counts.values()),
            }
        )
    waiting = dict(
        inbox.waiting(tasks).values("state").annotate(n=Count("id")).values_list("state", "n")
    )
    watchers = {
        row["watcher_status"]: row["n"]
        for row in tasks.exclude(state__in=TERMINAL_STATES)
        .values("watcher_status")
        .annotate(n=Count("id"))
        .order_by()
    }
    return {
        "agents": agents,
        "states": [_column_head(s) for s in states],
        "rows": rows,
        "totals": [totals.get(s, 0) for s in states],
        "grand_total": sum(totals.values()),
        # Those a person can still answer, as the inbox counts them (an abandoned question
        # is in the table's counts, but nobody can answer it).
        "needs_input": waiting.get("TASK_STATE_INPUT_REQUIRED", 0),
        "needs_auth": waiting.get("TASK_STATE_AUTH_REQUIRED", 0),
        "watchers": [
            {"status": s, "count": watchers.get(s, 0)}
            for s in ("streaming", "reconnecting", "polling", "awaiting-push", "lost")
        ],
        "recent": for_list(tasks.select_related("agent")).order_by("-updated_at", "-id")[:12],
        "now": timezone.now(),
    }


def _column_head(column: str) -> dict[str, str]:
    """Label and task-list query of an overview column (a state, or a phase without one)."""
    if column.startswith("phase:"):
        phase = column.removeprefix("phase:")
        return {
            "key": column,
            "label": PHASE_LABELS.get(phase, phase),
            "query": urlencode({"phase": phase}),
        }
    return {
        "key": column,
        "label": STATE_LABELS.get(column, column),
        "query": urlencode({"state": column}),
    }


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    context = _overview_context(request.user)
    if request.GET.get("fragment"):
        return render(request, "tasks_app/_overview_body.html", context)
    return render(request, "tasks_app/overview.html", context)


# Agents ------------------------------------------------------------------------------------


@login_required
def agent_list(request: HttpRequest) -> HttpResponse:
    counts: dict[int, int] = {
        row["agent_id"]: row["n"]
        for row in access.readable_tasks(request.user)
        .values("agent_id")
        .annotate(n=Count("id"))
        .order_by()
    }
    agents = list(
        access.readable_agents(request.user).defer(*AGENT_LIST_DEFERRED).select_related("project")
    )
    for agent in agents:
        agent.task_count = counts.get(agent.pk, 0)
    context = {
        "agents": [a for a in agents if a.retired_at is None],
        "retired": [a for a in agents if a.retired_at is not None],
    }
    return render(request, "tasks_app/agent_list.html", context)


@form_removes_nul
@login_required
def agent_add(request: HttpRequest) -> HttpResponse:
    projects = access.projects_for(request.user, Perm.MANAGE_AGENTS)
    if not projects.exists():
        raise access.refuse(request.user, Perm.MANAGE_AGENTS, what=access.describe(request))
    preview = None
    if request.method == "POST":
        form = AgentAddForm(request.POST, projects=projects)
        if form.is_valid():
            url = form.cleaned_data["url"]
            if request.POST.get("action") == "save":
                try:
                    agent = agent_services.add_agent(
                        url,
                        name=form.cleaned_data["name"],
                        project=form.cleaned_data["project"],
                        actor_id=request.user.id,
                    )
                except agent_services.AgentError as exc:
                    form.add_error("url", str(exc))
                else:
                    messages.success(request, f"Agent {agent.name} saved.")
                    return redirect("agent-detail", pk=agent.pk)
            else:
                try:
                    # A URL the project holds is said now, not after a preview whose Save
                    # could only be refused.
                    agent_services.check_not_registered(url, form.cleaned_data["project"])
                    preview = agent_services.preview_card(url)
                except agent_services.AgentError as exc:
                    form.add_error("url", str(exc))
        elif request.POST.get("action") == "save" and set(form.errors) == {"name"}:
            # Only the name was refused: the preview stays, with its Save (it was gone, and
            # the card had to be previewed again).
            with contextlib.suppress(agent_services.AgentError):
                preview = agent_services.preview_card(request.POST.get("url", "").strip())
    else:
        form = AgentAddForm(initial={"url": request.GET.get("url", "")}, projects=projects)
    # The fetched card through the same type-checked view as the agent page.
    card = _card_view(preview.card) if preview is not None else None
    return render(
        request, "tasks_app/agent_add.html", {"form": form, "preview": preview, "card": card}
    )


# A stored card is the agent's JSON as it came: any field may have any type. These read
# it with a type check at every step (a wrong type is skipped; validate_card says why).
CARD_PROBLEMS_SHOWN = 100
# Skills, interfaces and extensions of a card listed on a page (a 1 MB card can hold
# a hundred thousand): the rest is counted.
CARD_ITEMS_SHOWN = 100


def _obj(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _objs(value: object) -> list[dict]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _text(value: object) -> str:
    """A scalar as text; a list or object (the wrong type for a text field) as nothing."""
    if isinstance(value, str):
        return value
    return str(value) if isinstance(value, int | float) else ""


def _texts(value: object) -> list[str]:
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []


def _card_problems(card: object, known: object = ()) -> list[str]:
    """The problems found when the card was stored, then those the card itself has now."""
    problems = _texts(list(known)) if isinstance(known, list | tuple) else []
    try:
        found = [str(p) for p in validate_card(card)]
    except Exception:  # a page must render whatever the card holds
        log.exception("could not check a stored agent card")
        found = ["the card could not be checked (see the server log)"]
    listed = set(problems)
    problems += [p for p in found if p not in listed]
    if len(problems) > CARD_PROBLEMS_SHOWN:  # a card of 10k bad skills: a page, not a book
        more = len(problems) - CARD_PROBLEMS_SHOWN
        problems = [*problems[:CARD_PROBLEMS_SHOWN], f"… and {more} more problems"]
    return problems


def _skill_view(skill: dict) -> dict:
    return {
        "id": _text(skill.get("id")),
        "name": _text(skill.get("name")),
        "description": _text(skill.get("description")),
        "tags": _texts(skill.get("tags")),
        "examples": _texts(skill.get("examples")),
    }


def _more(items: object) -> int:
    """How many of a card's listed objects are past ``CARD_ITEMS_SHOWN``."""
    return max(0, len(_objs(items)) - CARD_ITEMS_SHOWN)


def _card_view(card: object, known_problems: object = ()) -> dict:
    """The parts of a card the agent page and the card preview show (templates escape them)."""
    raw = card
    card = _obj(card)
    capabilities = _obj(card.get("capabilities"))
    scheme_rows = []
    for name, scheme in _obj(card.get("securitySchemes")).items():
        kind = next(iter(scheme), "") if isinstance(scheme, dict) and scheme else ""
        detail = scheme.get(kind) if isinstance(scheme, dict) else None
        scheme_rows.append({"name": name, "kind": kind, "detail": pretty_json(detail)})
    provider = _obj(card.get("provider"))
    return {
        # As a name is shown anywhere: a bidi override in it reversed the heading.
        "name": agent_services.shown_name(_text(card.get("name"))),
        "description": _text(card.get("description")),
        "version": _text(card.get("version")),
        "provider": {
            "organization": _text(provider.get("organization")),
            "url": _text(provider.get("url")),
        },
        "capabilities": [
            {"name": k, "value": v}
            for k, v in capabilities.items()
            if not isinstance(v, list | dict)
        ],
        "streaming": capabilities.get("streaming") is True,
        "push": capabilities.get("pushNotifications") is True,
        "extensions": [
            {
                "uri": _text(e.get("uri")),
                "required": e.get("required") is True,
                "description": _text(e.get("description")),
            }
            for e in _objs(capabilities.get("extensions"))[:CARD_ITEMS_SHOWN]
        ],
        "extensions_more": _more(capabilities.get("extensions")),
        "skills": [_skill_view(s) for s in _objs(card.get("skills"))[:CARD_ITEMS_SHOWN]],
        "skills_more": _more(card.get("skills")),
        "interfaces": [
            {
                key: _text(i.get(key))
                for key in ("protocolBinding", "protocolVersion", "url", "tenant")
            }
            for i in _objs(card.get("supportedInterfaces"))[:CARD_ITEMS_SHOWN]
        ],
        "interfaces_more": _more(card.get("supportedInterfaces")),
        "schemes": scheme_rows,
        "requirements": pretty_json(card.get("securityRequirements"))
        if card.get("securityRequirements")
        else "",
        "input_modes": _texts(card.get("defaultInputModes")),
        "output_modes": _texts(card.get("defaultOutputModes")),
        "problems": _card_problems(raw, known_problems),
        **_raw_card(raw),
    }


# Of a card's indented JSON the agent page shows this many characters; the whole card is a
# download (``agent_card``). A card goes up to a megabyte, and every view drew it whole.
CARD_RAW_SHOWN = 64 * 1024


def _raw_card(card: object) -> dict[str, object]:
    text = pretty_json(card)
    return {"raw": text[:CARD_RAW_SHOWN], "raw_more": max(0, len(text) - CARD_RAW_SHOWN)}


def _agent_context(request: HttpRequest, agent: Agent, **extra: object) -> dict:
    return {
        "agent": agent,
        "card": _card_view(agent.card, agent.card_problems),
        "credentials_set": bool(agent.credentials_encrypted),
        "credentials_unreadable": not crypto.readable(agent.credentials_encrypted),
        "credentials_form": CredentialsForm(),
        "approved_origins": agent.credential_origins,
        "counts": _agent_counts(agent),
        "recent": for_list(RemoteTask.objects.filter(agent=agent), agent=None).order_by(
            "-updated_at", "-id"
        )[:15],
        "import_job": (job := import_services.latest_job(agent)),
        "can": access.can(request.user, agent.project_id),
        "rename_form": AgentRenameForm(initial={"name": agent.name, "was": agent.name}),
        **_lifecycle_context(agent, job),
        **extra,
    }


def _lifecycle_context(agent: Agent, job: ImportJob | None) -> dict:
    """What the Manage section offers: retire only when it can work (no open task, no import
    under way: one runs at a time, so only the newest job can), restore only while no other
    agent of the project holds the URL."""
    if agent.retired_at is not None:
        holder = agent_services.registered_at(agent.project, registration_url(agent.base_url))
        return {"url_taken_by": holder}
    return {
        "open_tasks": agent_services.open_tasks(agent.pk).count(),
        "import_running": job is not None and job.status in import_services.ACTIVE,
        "abandoned_running": agent_services.abandoned_but_running(agent.pk),
    }


def _agent_counts(agent: Agent) -> list[dict[str, object]]:
    """The agent's tasks by state, and those without one by phase, named and ordered as on
    the overview (a message reply is "message reply", not "unknown"); each with its
    task-list query."""
    counts: dict[str, int] = {}
    rows = RemoteTask.objects.filter(agent=agent).values("state", "phase")
    for row in rows.annotate(n=Count("id")).order_by():
        column = _overview_column(row["state"], row["phase"])
        counts[column] = counts.get(column, 0) + row["n"]
    order = [f"phase:{p}" for p in PHASE_LABELS] + [s for s, _ in STATE_CHOICES if s]
    columns = [c for c in order if c in counts] + sorted(c for c in counts if c not in order)
    return [{**_column_head(c), "n": counts[c]} for c in columns]


@login_required
def agent_detail(request: HttpRequest, pk: int) -> HttpResponse:
    agent = get_agent_for_user(request, pk)
    return render(request, "tasks_app/agent_detail.html", _agent_context(request, agent))


@login_required
@require_GET
def agent_card(request: HttpRequest, pk: int) -> HttpResponse:
    """The agent's stored card, whole, as a JSON download (the page shows its head)."""
    agent = get_agent_for_user(request, pk)
    response = HttpResponse(pretty_json(agent.card), content_type="application/json; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="agent-{agent.pk}-card.json"'
    return response


@sensitive_post_parameters("token", "api_key")
@login_required
@require_POST
def agent_credentials(request: HttpRequest, pk: int) -> HttpResponse:
    agent = get_agent_for_user(request, pk, Perm.MANAGE_AGENTS)
    if agent.retired_at is not None:  # a page drawn before the retire: said, not hidden
        messages.error(request, f"Nothing was saved. {outbound.retired_note(agent)}")
        return redirect("agent-detail", pk=agent.pk)
    form = CredentialsForm(request.POST)
    if form.is_valid():
        try:
            agent_services.set_credentials(agent, form.credentials(), actor_id=request.user.id)
        except agent_services.AgentError as exc:  # e.g. a character no header can carry
            field = "api_key" if form.cleaned_data["kind"] == "api-key" else "token"
            form.add_error(field, str(exc))
    if not form.is_valid():
        context = _agent_context(request, agent, credentials_form=form)
        return render(request, "tasks_app/agent_detail.html", context, status=400)
    messages.success(
        request,
        "Credentials removed." if form.cleaned_data["kind"] == "clear" else "Credentials saved.",
    )
    return redirect("agent-detail", pk=agent.pk)


@login_required
@require_POST
def agent_refresh(request: HttpRequest, pk: int) -> HttpResponse:
    agent = get_agent_for_user(request, pk, Perm.MANAGE_AGENTS)
    try:
        agent_services.refresh_card(agent, actor_id=request.user.id)
    except agent_services.AgentError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, "Card refreshed.")
    return redirect("agent-detail", pk=agent.pk)


@login_required
@require_POST
def agent_import(request: HttpRequest, pk: int) -> HttpResponse:
    """Queue an import job and return at once; the agent page shows its progress."""
    agent = get_agent_for_user(request, pk, Perm.OPERATE)
    try:
        job = import_services.start_import(agent, actor_id=request.user.id)
    except task_services.TaskActionError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Import started (job {job.pk}); its progress is shown below.")
    return redirect("agent-detail", pk=agent.pk)


@login_required
@require_GET
def agent_import_status(request: HttpRequest, pk: int) -> HttpResponse:
    """The agent's newest import job as a fragment (the agent page polls it while it runs)."""
    agent = get_agent_for_user(request, pk)
    context = {
        "agent": agent,
        "import_job": import_services.latest_job(agent),
        "can": access.can(request.user, agent.project_id),
    }
    return render(request, "tasks_app/_import_job.html", context)


@login_required
@require_POST
def agent_import_cancel(request: HttpRequest, pk: int, job_pk: int) -> HttpResponse:
    agent = get_agent_for_user(request, pk, Perm.OPERATE)
    job = get_object_or_404(ImportJob, pk=job_pk, agent=agent)
    if import_services.cancel_job(job, actor_id=request.user.id):
        messages.success(request, f"Import job {job.pk} canceled.")
    else:
        messages.error(request, f"Import job {job.pk} had already ended.")
    return redirect("agent-detail", pk=pk)


@form_removes_nul
@login_required
@require_POST
def agent_rename(request: HttpRequest, pk: int) -> HttpResponse:
    agent = get_agent_for_user(request, pk, Perm.MANAGE_AGENTS)
    form = AgentRenameForm(request.POST)
    if form.is_valid():
        old = agent.name
        try:
            agent_services.rename_agent(
                agent,
                form.cleaned_data["name"],
                was=form.cleaned_data["was"],
                actor_id=request.user.id,
            )
        except agent_services.AgentError as exc:
            # The form comes back with the name the agent has now as the one seen, so that
            # sending it again (after reading the message) renames it.
            agent.refresh_from_db()
            form = AgentRenameForm({"name": request.POST.get("name", ""), "was": agent.name})
            form.is_valid()
            form.add_error("name", str(exc))
        else:
            if agent.name != old:
                messages.success(request, f"Renamed {old} to {agent.name}.")
            return redirect("agent-detail", pk=agent.pk)
    context = _agent_context(request, agent, rename_form=form)
    return render(request, "tasks_app/agent_detail.html", context, status=400)


def _agent_lifecycle(request: HttpRequest, pk: int, change: Callable, done: str) -> HttpResponse:
    """Retire or restore (``change``), then back to the agent page with its sentence."""
    agent = get_agent_for_user(request, pk, Perm.MANAGE_AGENTS)
    try:
        change(agent, actor_id=request.user.id)
    except agent_services.AgentError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, done.format(name=agent.name))
    return redirect("agent-detail", pk=agent.pk)


@login_required
@require_POST
def agent_retire(request: HttpRequest, pk: int) -> HttpResponse:
    return _agent_lifecycle(
        request, pk, agent_services.retire_agent,
        "{name} is retired: nothing is sent to it, its credentials are deleted, and its tasks "
        "stay readable.",
    )  # fmt: skip


@login_required
@require_POST
def agent_restore(request: HttpRequest, pk: int) -> HttpResponse:
    return _agent_lifecycle(
        request, pk, agent_services.restore_agent,
        "{name} is back in service. Its credentials were deleted when it was retired; set them "
        "again if it needs them.",
    )  # fmt: skip


@login_required
@require_POST
def agent_approve_origin(request: HttpRequest, pk: int) -> HttpResponse:
    """Let the stored credentials go to the origin a refreshed card moved the agent to."""
    agent = get_agent_for_user(request, pk, Perm.MANAGE_AGENTS)
    origin = request.POST.get("origin", "")
    if agent.retired_at is not None:
        messages.error(request, f"Nothing to approve. {outbound.retired_note(agent)}")
    elif agent_services.approve_origin(agent, origin, actor_id=request.user.id):
        messages.success(request, f"Credentials may now be sent to {origin}.")
    else:
        messages.error(
            request, "Nothing to approve: the agent's origin changed again or was approved already."
        )
    return redirect("agent-detail", pk=agent.pk)


# Task list (keyset pagination) ---------------------------------------------------------------

SORTS = {
    "-updated": ("updated_at", True),
    "updated": ("updated_at", False),
    "-created": ("created_at", True),
    "created": ("created_at", False),
}


def filtered_tasks(user, data: dict) -> tuple:
    """The person's tasks, filtered (unordered), and the sort, from cleaned filter data."""
    qs = access.readable_tasks(user)
    if data.get("agent"):
        qs = qs.filter(agent=data["agent"])
    state = data.get("state")
    if state == "active":
        qs = qs.exclude(state__in=TERMINAL_STATES)
    elif state == "open":
        qs = qs.filter(task_services.still_open())
    elif state:
        qs = qs.filter(state=state)
    if data.get("phase"):
        qs = qs.filter(phase=data["phase"], state="")
    if data.get("context"):
        qs = qs.filter(context_id=data["context"].strip())
    q = (data.get("q") or "").strip()
    if q:
        qs = qs.filter(Q(remote_id=q) | Q(title__icontains=q) | Q(remote_id__istartswith=q))
    sort = data.get("sort") or "-updated"
    return qs, SORTS.get(sort, SORTS["-updated"]), sort


@login_required
def task_list(request: HttpRequest) -> HttpResponse:
    readable_agents = access.readable_agents(request.user).defer(*AGENT_LIST_DEFERRED)
    form = TaskFilterForm(request.GET or None, agents=readable_agents)
    valid = not form.is_bound or form.is_valid()
    data = form.cleaned_data if form.is_bound and valid else {}
    qs, (field, desc), sort = filtered_tasks(request.user, data)
    if not valid:
        # As on the audit page: nothing is listed under a filter that is not valid (all
        # tasks would look like the filtered result), until it is corrected.
        qs = qs.none()
    cursor_text = request.GET.get("cursor", "")
    cursor = cursors.decode(cursor_text) if cursor_text else None
    cursor_broken = bool(cursor_text) and cursor is None
    page_qs = qs.none() if cursor_broken else qs
    if cursor:
        page_qs = page_qs.filter(cursors.after(field, *cursor, descending=desc))
    order = [f"-{field}", "-pk"] if desc else [field, "pk"]
    rows = list(for_list(page_qs.select_related("agent")).order_by(*order)[: PAGE_SIZE + 1])
    has_next = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    # A bounded count: never a full COUNT(*) over a huge table.
    count = qs.order_by().values("pk")[: COUNT_LIMIT + 1].count()
    base_params = {k: v for k, v in request.GET.items() if k != "cursor" and v}
    next_url = ""
    if has_next and rows:
        last = rows[-1]
        next_url = "?" + urlencode(
            {**base_params, "cursor": cursors.encode(getattr(last, field), last.pk)}
        )
    first_url = "?" + urlencode(base_params) if cursor_text else ""
    agents = {a.pk: a.name for a in readable_agents}
    context = {
        "form": form,
        "tasks": rows,
        "count": count,
        "count_capped": count > COUNT_LIMIT,
        "count_limit": COUNT_LIMIT,
        "valid": valid,
        "next_url": next_url,
        "first_url": first_url,
        "cursor_broken": cursor_broken,
        "live_filters": {
            "agent": data["agent"].pk if data.get("agent") else None,
            "state": data.get("state") or "",
            "phase": data.get("phase") or "",
            "context": data.get("context") or "",
            "q": data.get("q") or "",
            # New tasks are prepended only on the first page of the default order.
            "prepend": valid and not cursor_text and sort == "-updated",
        },
        "agent_names": {str(k): v for k, v in agents.items()},
        "state_labels": STATE_LABELS,
        "phase_labels": PHASE_LABELS,
    }
    # As the audit page answers: the filter or the page link as asked cannot be applied (the
    # page says which). A broken link lists nothing: its rows would pass for the next page.
    status = 200 if valid and not cursor_broken else 400
    return render(request, "tasks_app/task_list.html", context, status=status)


@login_required
@require_GET
def task_row(request: HttpRequest, pk: int) -> HttpResponse:
    """One row of the task list (server-rendered, for live inserts)."""
    task = get_task_for_user(request, pk)
    return render(request, "tasks_app/_task_row.html", {"task": task})


# Starting a task ---------------------------------------------------------------------------


def _skills_by_agent(agents) -> list[dict]:
    out = []
    for agent in agents:
        for skill in map(_skill_view, _objs(_obj(agent.card).get("skills"))[:CARD_ITEMS_SHOWN]):
            if skill["id"]:
                out.append(
                    {
                        "agent": agent.pk,
                        "id": skill["id"],
                        "name": skill["name"] or skill["id"],
                        "description": skill["description"],
                        "examples": skill["examples"][:5],
                    }
                )
    return out


# The start form's first choice when the agent asked for cannot be offered: the form would
# otherwise preselect another agent without a word, and the task go there.
CHOOSE_AGENT = "Choose an agent"


def _agent_not_offered(request: HttpRequest, wanted: str) -> str:
    """Why the start form does not offer agent ``wanted`` (a link's, or a form drawn earlier)."""
    retired = (
        access.readable_agents(request.user)
        .filter(pk=safejson.whole_number(wanted) or 0)
        .exclude(retired_at=None)
        .first()
    )
    if retired is not None:
        return f"{retired.name} is retired: choose another agent."
    return "The agent asked for is not one you can start tasks on: choose one."


@form_removes_nul
@login_required
def task_new(request: HttpRequest) -> HttpResponse:
    operable = access.readable_agents(request.user, Perm.OPERATE).filter(retired_at__isnull=True)
    agents = list(operable)
    if not agents and not access.projects_for(request.user, Perm.OPERATE).exists():
        raise access.refuse(request.user, Perm.OPERATE, what=access.describe(request))
    if request.method == "POST":
        form = StartTaskForm(
            request.POST, request.FILES, agents=operable, person_id=request.user.id
        )
        if form.is_valid():
            data = form.cleaned_data
            metadata = {"skill": data["skill"]} if data.get("skill") else None
            files = (data["file_part"],) if data.get("file_part") else ()
            charged, refused = upload_budget.charge(request.user.id, files)
            try:
                if refused:
                    raise task_services.TaskActionError(refused)
                task = task_services.start_task(
                    data["agent"],
                    data.get("text") or "",
                    mode=data["mode"],
                    data=data.get("data"),
                    files=files,
                    from_browser=True,
                    actor_id=request.user.id,
                    metadata=metadata,
                )
            except task_services.TaskActionError as exc:
                upload_budget.refund(request.user.id, charged)
                message = str(exc)
                if refused:
                    form.add_error("file", message)
                else:
                    form.add_error(
                        "mode" if "mode" in message or "stream" in message else None, message
                    )
            else:
                if data.get("kept_file"):
                    kept_uploads.drop(request.user.id)
                return redirect("task-detail", pk=task.pk)
        if form.has_error("agent", code="invalid_choice"):  # retired since drawn, say
            form.errors["agent"] = form.error_class(
                [_agent_not_offered(request, request.POST.get("agent", ""))]
            )
            form.fields["agent"].empty_label = CHOOSE_AGENT
            form.data = form.data.copy()
            form.data["agent"] = ""  # drawn with the empty choice selected
        form.keep_file()
        status = 400
    else:
        initial = {"mode": RemoteTask.Mode.AUTO}
        if request.GET.get("text"):
            initial["text"] = request.GET["text"]
        form = StartTaskForm(initial=initial, agents=operable)
        wanted = request.GET.get("agent", "")
        if wanted and any(str(agent.pk) == wanted for agent in agents):
            form.initial["agent"] = wanted
        elif wanted:
            messages.warning(request, _agent_not_offered(request, wanted))
            form.fields["agent"].empty_label = CHOOSE_AGENT
            form.initial["agent"] = ""
        status = 200
    context = {"form": form, "agents": agents, "skills": _skills_by_agent(agents)}
    return render(request, "tasks_app/task_new.html", context, status=status)


# Task page ---------------------------------------------------------------------------------


def _download_url(task: RemoteTask, artifact: Artifact):
    return lambda index: reverse("artifact-download", args=[task.pk, artifact.pk, index])


def _message_download_url(task: RemoteTask, message: ConversationMessage):
    return lambda index: reverse("message-download", args=[task.pk, message.pk, index])


# Artifacts previewed on a task page (each up to ARTIFACT_PREVIEW_BYTES): a task of 2,000
# artifacts made a 2.8 s page. The rest are counted; the export holds them all.
ARTIFACTS_ON_PAGE = 100


def artifact_blocks(task: RemoteTask, only: list[str] | None = None) -> list[dict]:
    """The first ``ARTIFACTS_ON_PAGE`` artifacts (of ``only``, when given) as bounded previews
    (ARTIFACT_PREVIEW_BYTES); the whole of each is a download."""
    qs = Artifact.objects.filter(task=task)
    if only is not None:
        qs = qs.filter(artifact_id__in=only[:ARTIFACTS_ON_PAGE])
    blocks = []
    for artifact in qs[:ARTIFACTS_ON_PAGE]:
        preview = artifact_preview(artifact, _download_url(task, artifact))
        blocks.append(
            {
                "artifact": artifact,
                **preview,
                "download_all": reverse("artifact-download-all", args=[task.pk, artifact.pk]),
            }
        )
    return blocks


def _conversation(task: RemoteTask) -> list[dict]:
    """The newest ``MESSAGES_ON_PAGE`` messages, oldest first, each read for the page within
    its bounds (``previews.conversation_messages``)."""
    page = ConversationMessage.objects.filter(task=task).order_by("-seq", "-id")
    shown_chars = rendering.MESSAGE_SHOWN_CHARS
    shown = conversation_messages(page, MESSAGES_ON_PAGE, shown_chars)
    items = []
    for m, message, cut_from in reversed(shown):
        download = _message_download_url(task, m)
        items.append(
            {
                "m": m,
                "message": message,
                "agent": m.role == "ROLE_AGENT",
                "html": message_html(message, download)
                if cut_from is None
                else cut_message_html(message, cut_from, download, shown_chars),
            }
        )
    return views_a2ui.add_conversation_surfaces(task, items)  # A2UI surfaces they carried


TIMELINE_TICKS = 400


def _timeline(task: RemoteTask):
    """The state changes (an indexed few) and evenly spaced ticks, never the whole log.

    An exchange that can no longer change (a plain message reply, a send that failed, an
    abandoned task) ends at its last entry, like a task in a terminal state.
    """
    step = max(1, task.last_seq // TIMELINE_TICKS)
    ticks = {*range(1, task.last_seq + 1, step), task.last_seq}
    changes = Q(state_changed=True)
    if task.events.filter(changes)[TIMELINE_TICKS : TIMELINE_TICKS + 1].exists():
        # An agent switching states to and fro made every change a row of the page (50,000 of
        # them: 47 MB and 8.7 s a view): past TIMELINE_TICKS, the first change of each of
        # TIMELINE_TICKS spans of the log; the ticks between them still carry each state.
        width = -(-task.last_seq // TIMELINE_TICKS)  # rounded up: at most TIMELINE_TICKS spans
        firsts = (
            task.events.filter(changes)
            .annotate(span=F("seq") / width)
            .values("span")
            .annotate(first=Min("seq"))
            .values("first")
        )
        changes = Q(seq__in=firsts)
    rows = task.events.filter(changes | Q(seq__in=ticks)).order_by("seq")
    over = (
        task.phase in (RemoteTask.Phase.MESSAGE, RemoteTask.Phase.FAILED)
        or task.abandoned_at is not None
    )
    return timeline_svg(
        list(rows.values_list("seq", "received_at", "state_after")), ended=over or None
    )


def _status_html(task: RemoteTask):
    return message_html(task.status_message) if task.status_message else ""


def _artifacts_not_shown(task: RemoteTask, shown: list[dict]) -> int:
    if len(shown) < ARTIFACTS_ON_PAGE:
        return 0
    return Artifact.objects.filter(task=task).count() - len(shown)


def _task_context(request: HttpRequest, task: RemoteTask, *, artifacts: bool = True) -> dict:
    """What the task page and its live redraws show; ``artifacts=False`` for the redraws,
    which preview only the artifacts asked for."""
    can = access.can(request.user, task.agent.project_id)
    # Buttons a person may not use are not shown (the server refuses them anyway).
    actions = {
        **task_services.offered_actions(task),
        "can_answer": task.state in INTERRUPTED_STATES
        and task.abandoned_at is None
        and task.gone_at is None,
    }
    return {
        "task": task,
        "can": can,
        "status_html": _status_html(task),
        "conversation": _conversation(task),
        "timeline": _timeline(task),
        "artifacts": (shown := artifact_blocks(task) if artifacts else []),
        "artifacts_more": _artifacts_not_shown(task, shown) if artifacts else 0,
        "cancel_form": CancelForm(),
        "answer_form": answers.answer_form(task),  # from the agent's answer schema, or free text
        # A2UI forms the agent drew; drawn only where a template shows them (the full page).
        "surfaces": lambda: views_a2ui.surfaces_block(request, task),
        **{name: allowed and can["operate"] for name, allowed in actions.items()},
        "waiting_for_answer": actions["can_answer"],
    }


@login_required
@markdown_budgeted  # agents' markdown: a bounded cost per page
def task_detail(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_task_for_user(request, pk, related=("started_by",))
    return render(request, "tasks_app/task_detail.html", _task_page_context(request, task))


def _task_page_context(request: HttpRequest, task: RemoteTask) -> dict:
    """Everything the whole task page shows: as loaded, and as shown again with a refused form."""
    events = list(with_raw_preview(task.events).order_by("-seq")[:EVENTS_ON_TASK_PAGE])
    events.reverse()
    context = _task_context(request, task)
    context.update(
        {
            "events": [{"e": e, "raw": raw_preview(e)} for e in events],
            "first_seq": events[0].seq if events else 0,
            # The page holds everything up to here; the websocket resumes after it.
            "page_seq": events[-1].seq if events else 0,
            "summary": task_summary(task),
            "chain": _chain(request, task),
        }
    )
    return context


def _chain(request: HttpRequest, task: RemoteTask) -> audit.Verification | None:
    """Whether the task's hash chain verifies: checked on every load while the log is short;
    a long one on request only (remembered by its head, one check at a time, a few an hour
    per person: ``audit.verify_on_request``), else its remembered outcome or None."""
    checked = audit.verify_for_page(task)
    if checked is not None:
        return checked
    # Asked by a POST (its form on the page): a check reads the whole log and counts against
    # the person's hour, which a GET let any other site's page spend for them.
    verify = request.POST.get("verify") if request.method == "POST" else None
    if verify:
        return audit.verify_on_request(task, request.user.pk, again=verify == "again")
    return audit.remembered(task)


@login_required
@require_GET
@markdown_budgeted
def task_live(request: HttpRequest, pk: int) -> JsonResponse:
    """Server-rendered (sanitized) fragments of the task page, for live redraws."""
    task = get_task_for_user(request, pk)
    context = _task_context(request, task, artifacts=False)
    wanted = request.GET.getlist("artifact")
    artifacts = artifact_blocks(task, None if request.GET.get("all_artifacts") else wanted)
    return JsonResponse(
        {
            "summary": task_summary(task),
            "state_label": task.state_label,
            "last_event_at": task.last_event_at.isoformat() if task.last_event_at else None,
            "html": {
                "head": render_to_string("tasks_app/_task_head.html", context, request=request),
                "watch": render_to_string("tasks_app/_task_watch.html", context, request=request),
                "status": render_to_string("tasks_app/_task_status.html", context, request=request),
                "conversation": render_to_string(
                    "tasks_app/_task_conversation.html", context, request=request
                ),
                "timeline": str(context["timeline"]),
                "actions": render_to_string(
                    "tasks_app/_task_actions.html", context, request=request
                ),
            },
            "artifacts": [
                {
                    "artifact_id": b["artifact"].artifact_id,
                    "updated_seq": b["seq"],
                    "html": render_to_string(
                        "tasks_app/_artifact.html", {"block": b, "task": task}, request=request
                    ),
                }
                for b in artifacts
            ],
        }
    )


def _back_to_task(task: RemoteTask) -> HttpResponseRedirect:
    return redirect("task-detail", pk=task.pk)


def _act(
    request: HttpRequest, task: RemoteTask, action: Callable[[], object], done: str
) -> HttpResponse:
    """Run a service action; say plainly what went wrong, or that it was done."""
    try:
        action()
    except task_services.TaskActionError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, done)
    return _back_to_task(task)


# The page offers these actions only in some states (``services.tasks.offered_actions``); the
# server takes no more than the page offers. A crafted POST for a hidden one (abandoning an
# ended task, refreshing or canceling a plain message reply) is refused here, before the
# service writes a log entry or an operator-action row for an action that cannot happen.
def _offered(request: HttpRequest, task: RemoteTask, action: str) -> bool:
    """Whether the task page offers ``action`` now; if not, say so (nothing is recorded)."""
    if task_services.offered_actions(task)[action]:
        return True
    if action == "can_abandon" and task.abandoned_at is not None:
        messages.error(request, "This task was abandoned already.")
    else:
        messages.error(request, task_services.not_offered(task, action))
    return False


def _reason(request: HttpRequest) -> str | None:
    """The optional reason a cancel or abandon form carries; None (and a message) when invalid."""
    form = CancelForm(request.POST)
    if not form.is_valid():
        messages.error(request, "The reason is too long.")
        return None
    return form.cleaned_data["reason"]


@login_required
@require_POST
def task_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    reason = _reason(request)
    if reason is None or not _offered(request, task, "can_cancel"):
        return _back_to_task(task)
    return _act(
        request,
        task,
        lambda: task_services.cancel_task(task, reason=reason, actor_id=request.user.id),
        "Cancel requested.",
    )


@login_required
@require_POST
def task_refresh(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    if not _offered(request, task, "can_refresh"):
        return _back_to_task(task)
    return _act(
        request,
        task,
        lambda: task_services.refresh_task(task, actor_id=request.user.id),
        "Refreshed from the agent.",
    )


@login_required
@require_POST
def task_abandon(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    reason = _reason(request)
    if reason is None or not _offered(request, task, "can_abandon"):
        return _back_to_task(task)
    who = request.user.get_username()
    return _act(
        request,
        task,
        lambda: task_services.abandon_task(
            task, reason=reason, actor_id=request.user.id, actor_name=who
        ),
        "Abandoned: this task is no longer watched.",
    )


@login_required
@require_POST
def task_watch_again(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    return _act(
        request,
        task,
        lambda: task_services.watch_again(task, actor_id=request.user.id),
        "Watching again.",
    )


@login_required
@require_POST
def task_retry(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    return _act(
        request,
        task,
        lambda: task_services.retry_send(task, actor_id=request.user.id),
        "Sending again (same messageId).",
    )


@form_removes_nul
@login_required
@require_POST
def task_answer(request: HttpRequest, pk: int) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    # Validated (against the agent's schema, when it sent one) and sent by tasks_app.answers.
    sent, form = answers.submit(
        request, task, answers.answer_form(task, request.POST, request.FILES)
    )
    if sent:
        messages.success(request, "Answer sent.")
        return _back_to_task(task)
    # Re-render the page with the answer form and what was typed.
    return _render_task_with(request, task, answer_form=form)


def _render_task_with(request: HttpRequest, task: RemoteTask, **forms) -> HttpResponse:
    with markdown_budget():
        return _render_task_page_with(request, task, **forms)


def _render_task_page_with(request: HttpRequest, task: RemoteTask, **forms) -> HttpResponse:
    # The whole page, chain sentence included (without it, a short log was said to be "too
    # large to check on every load").
    context = _task_page_context(request, task)
    context.update(forms)
    return render(request, "tasks_app/task_detail.html", context, status=400)


@login_required
@require_http_methods(["GET", "POST"])  # POST: the hash chain's "verify now" (see _chain)
def task_events(request: HttpRequest, pk: int) -> HttpResponse:
    """The whole log, a page at a time (by seq): full, compact (by state and artifact) or raw.

    Filters by kind and channel come in the URL; a value that is not one of them is
    answered next to its filter, with 400 and no entries, as on the task list and the audit
    page: the whole log under a filter the page shows would pass for the filtered one.
    """
    task = get_task_for_user(request, pk)
    try:
        after = max(0, int(request.GET.get("after", "0")))
    except ValueError:
        return HttpResponseBadRequest("after must be a number")
    form = EventFilterForm(request.GET)
    valid = form.is_valid()
    wanted = {k: v for k, v in form.cleaned_data.items() if v and k not in form.errors}
    view = wanted.get("view", "full")
    status = 200 if valid else 400
    context: dict = {
        "task": task, "form": form, "view": view, "chain": _chain(request, task),
        # This task's project's permissions: auditing another project offers no export here.
        "can": access.can(request.user, task.agent.project_id),
    }  # fmt: skip
    if view == "compact" and valid:
        context.update(_compact_history(task))
        return render(request, "tasks_app/task_events.html", context)
    matching = task.events.all() if valid else task.events.none()
    if wanted.get("kind"):
        matching = matching.filter(kind=wanted["kind"])
    if wanted.get("channel"):
        matching = matching.filter(channel=wanted["channel"])
    entries = matching.filter(seq__gt=after)
    rows = list(
        with_raw_preview(entries).select_related("actor").order_by("seq")[: EVENTS_ON_PAGE + 1]
    )
    has_next = len(rows) > EVENTS_ON_PAGE
    rows = rows[:EVENTS_ON_PAGE]
    params = {k: v for k, v in wanted.items() if k != "view" or v != "full"}
    next_after = rows[-1].seq if has_next and rows else None
    context.update(
        {
            "events": [{"e": e, "raw": raw_preview(e)} for e in rows],
            "next_url": "?" + urlencode({**params, "after": next_after}) if next_after else "",
            "previous_url": _earlier_entries(matching, after, params),
            "valid": valid,
        }
    )
    return render(request, "tasks_app/task_events.html", context, status=status)


def _earlier_entries(matching: QuerySet[TaskEvent], after: int, params: dict) -> str:
    """The link to the page of entries before ``after`` (none on the first page): the page
    whose last entry is the last one up to ``after``, found backwards on the (task, seq)
    index. A page past the first had a way forward only."""
    if after <= 0:
        return ""
    before = list(
        matching.filter(seq__lte=after)
        .order_by("-seq")
        .values_list("seq", flat=True)[EVENTS_ON_PAGE : EVENTS_ON_PAGE + 1]
    )
    query = {**params, "after": before[0]} if before else params
    return "?" + urlencode(query) if query else "?"


def _compact_history(task: RemoteTask) -> dict:
    """The log grouped: runs of one state (from the indexed state changes) and the artifacts.

    Never reads the whole log: the state runs come from the rows where the state changed,
    the artifacts from the folded view (one row each, with the seq that last changed it).
    """
    changes = list(
        task.events.filter(state_changed=True)
        .order_by("seq")
        .values_list("seq", "received_at", "state_after")[:1000]
    )
    runs = []
    for i, (seq, at, state) in enumerate(changes):
        following = changes[i + 1] if i + 1 < len(changes) else None
        runs.append(
            {
                "state": state,
                "from_seq": seq,
                "to_seq": following[0] - 1 if following else task.last_seq,
                "since": at,
                "until": following[1] if following else task.last_event_at,
            }
        )
    # The first ARTIFACTS_ON_PAGE, as the task page shows them (an agent's 20,000 were a
    # 2 MB table and seconds a view); the rest are counted, one click from their entries.
    artifacts = task.artifacts.order_by("position").only(
        "name", "artifact_id", "part_count", "complete", "updated_seq", "position"
    )
    rows = list(artifacts[: ARTIFACTS_ON_PAGE + 1])
    more = 0
    if len(rows) > ARTIFACTS_ON_PAGE:
        rows = rows[:ARTIFACTS_ON_PAGE]
        more = artifacts.count() - ARTIFACTS_ON_PAGE
    return {"runs": runs, "artifact_rows": rows, "artifacts_more": more}


@login_required
@require_GET
def event_detail(request: HttpRequest, pk: int, seq: int) -> HttpResponse:
    """One log entry. Its JSON is shown indented up to ``EVENT_PAGE_JSON_CHARS``; a longer
    one (an agent's entry may be ``WATCH_MAX_EVENT_BYTES``) is shown as stored, cut there by
    the database, with a link to the whole: an 8 MB entry made an 8 MB page and took 56 MB
    of the web process, for any reader, each time."""
    task = get_task_for_user(request, pk)
    if request.GET.get("format") == "json":
        event = get_object_or_404(TaskEvent, task=task, seq=seq)
        body: dict[str, Any] = {"seq": event.seq, "raw": event.raw}
        if references_in(event.raw):
            # A big content lives once, in its artifact or conversation row, and the entry
            # keeps a reference: as an export does, the contents come beside the entry.
            body["contents"] = exports.entry_contents(event)
        return JsonResponse(body, json_dumps_params={"indent": 2})
    as_text = Cast("raw", TextField())
    event = get_object_or_404(
        TaskEvent.objects.defer("raw").annotate(
            raw_chars=Length(as_text), raw_head=Substr(as_text, 1, EVENT_PAGE_JSON_CHARS)
        ),
        task=task,
        seq=seq,
    )
    cut = max(0, event.raw_chars - EVENT_PAGE_JSON_CHARS)
    # Short, the head is the whole entry's JSON text: indented from it, not read again.
    raw = event.raw_head if cut else pretty_json(json.loads(event.raw_head))
    # The row's note says when it keeps references (an agent's own ``$stored`` key is none).
    refers = STORED_ONCE in event.note
    return render(
        request,
        "tasks_app/event_detail.html",
        {"task": task, "event": event, "raw": raw, "cut": cut, "refers": refers},
    )


# The most characters of an entry's JSON its page shows (see event_detail).
EVENT_PAGE_JSON_CHARS = 256 * 1024


def _attachment(part: dict, default_name: str) -> HttpResponse:
    content = decode_raw(part)
    media = download_content_type(part.get("mediaType"))
    if content is None:
        raise Http404("This part has no downloadable bytes.")
    name = safe_filename(part.get("filename"), default_name)
    response = HttpResponse(content, content_type=media)
    _download_headers(response, name, default_name)
    return response


def _download_headers(
    response: HttpResponse | StreamingHttpResponse, name: str, default_name: str
) -> None:
    """An attachment that the browser never renders or sniffs (agent content)."""
    ascii_name = name.encode("ascii", "ignore").decode() or default_name
    response["Content-Disposition"] = f'attachment; filename="{ascii_name}"'
    response["X-Content-Type-Options"] = "nosniff"
    response["Content-Security-Policy"] = "default-src 'none'; sandbox"
    response["Cache-Control"] = "private, no-store"


@login_required
@require_GET
def artifact_download_all(request: HttpRequest, pk: int, artifact_pk: int) -> StreamingHttpResponse:
    """The whole artifact, streamed from the database in batches (memory stays bounded)."""
    task = get_task_for_user(request, pk)
    artifact = get_object_or_404(Artifact, pk=artifact_pk, task=task)
    text = artifact_is_text(artifact.pk)
    chunks = (
        artifact_chunks_async(artifact.pk)
        if isinstance(request, ASGIRequest)
        else artifact_chunks(artifact.pk)
    )
    response = StreamingHttpResponse(
        chunks, content_type="text/plain; charset=utf-8" if text else "application/octet-stream"
    )
    default_name = f"artifact-{artifact.pk}"
    name = safe_filename(artifact.name or artifact.artifact_id, default_name)
    _download_headers(response, name + (".txt" if text and "." not in name else ""), default_name)
    return response


@login_required
@require_GET
def artifact_download(request: HttpRequest, pk: int, artifact_pk: int, index: int) -> HttpResponse:
    task = get_task_for_user(request, pk)
    artifact = get_object_or_404(Artifact, pk=artifact_pk, task=task)
    part = artifact.parts.filter(index=index).first()
    if part is None or not isinstance(part.part, dict):
        raise Http404("No such part.")
    return _part_download(part.part, f"artifact-{artifact.pk}-{index}")


def _part_download(part: dict, name: str) -> HttpResponse:
    """One part as a download: a file's bytes, a data part's JSON, a text part's text (the
    last two for parts too big for a page)."""
    if "raw" in part:
        return _attachment(part, name)
    if "data" in part:
        body, media, suffix = pretty_json(part["data"]), "application/json", ".json"
    elif isinstance(part.get("text"), str):
        body, media, suffix = part["text"], "text/plain; charset=utf-8", ".txt"
    else:
        return _attachment(part, name)
    response = HttpResponse(body.encode("utf-8", "replace"), content_type=media)
    _download_headers(response, f"{name}{suffix}", name)
    return response


@login_required
@require_GET
def message_download(request: HttpRequest, pk: int, message_pk: int, index: int) -> HttpResponse:
    task = get_task_for_user(request, pk)
    message = get_object_or_404(ConversationMessage, pk=message_pk, task=task)
    parts = message.message.get("parts") if isinstance(message.message, dict) else None
    if (
        not isinstance(parts, list)
        or not 0 <= index < len(parts)
        or not isinstance(parts[index], dict)
    ):
        raise Http404("No such part.")
    return _part_download(parts[index], f"message-{message.pk}-{index}")
