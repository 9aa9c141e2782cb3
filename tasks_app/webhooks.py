"""The push webhook (public: agents call it) and the task page's push-config views.

The webhook has no login and no CSRF token: an agent is not a browser. It is
authenticated per config instead (``tasks_app.services.push.accept``: the config's
token and ``Authorization`` credentials in constant time, a signed token when the
agent signs), and answers at once; recording happens in the worker.
"""

from __future__ import annotations

import logging

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from tasks_app.access import Perm, get_task_for_user
from tasks_app.models import RemoteTask
from tasks_app.services import push as push_services
from tasks_app.services import tasks as task_services

log = logging.getLogger(__name__)


def _source(request: HttpRequest) -> str:
    """The peer's address (a proxy in front must be configured to pass the real one)."""
    return str(request.META.get("REMOTE_ADDR") or "unknown")


@csrf_exempt
def receive(request: HttpRequest, config_id: str) -> HttpResponse:
    """One delivery: 202 once queued, 200 for a repeat, 4xx with a short reason otherwise."""
    if request.method != "POST":
        return JsonResponse({"error": "POST a StreamResponse"}, status=405, headers={"Allow": "POST"})
    limit = push_services.settings.PUSH_MAX_BODY_BYTES
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        return JsonResponse({"error": "body too large"}, status=413)
    body = request.read(limit + 1)
    verdict = push_services.accept(
        config_id,
        body=body,
        content_type=request.META.get("CONTENT_TYPE", ""),
        authorization=request.META.get("HTTP_AUTHORIZATION", ""),
        token=request.META.get("HTTP_X_A2A_NOTIFICATION_TOKEN", ""),
        source=_source(request),
    )
    payload = {"status": verdict.reason} if verdict.accepted else {"error": verdict.reason}
    headers = {"Retry-After": "1"} if verdict.status == 429 else None
    return JsonResponse(payload, status=verdict.status, headers=headers)


@login_required
@require_GET
def push_configs(request: HttpRequest, pk: int) -> HttpResponse:
    """The task's push configs as the agent lists them (ListTaskPushNotificationConfigs), with ours."""
    task = get_task_for_user(request, pk)
    listing = push_services.list_at_agent(task)
    return render(
        request,
        "tasks_app/_push_configs_list.html",
        {"task": task, "listing": listing, "can_operate": _can_operate(request, task)},
    )


def _can_operate(request: HttpRequest, task: RemoteTask) -> bool:
    from tasks_app.access import can

    return can(request.user, task.agent.project_id)["operate"]


@login_required
@require_POST
def push_config_delete(request: HttpRequest, pk: int, config_id: str) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    try:
        push_services.delete_config(task, config_id, actor_id=request.user.id)
    except task_services.TaskActionError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, "Push config deleted at the agent.")
    return redirect("task-detail", pk=task.pk)


@login_required
@require_POST
def task_watch_mode(request: HttpRequest, pk: int) -> HttpResponse:
    """Switch how a task is followed (stream or poll instead of push)."""
    task = get_task_for_user(request, pk, Perm.OPERATE)
    watch = request.POST.get("watch", "")
    try:
        task_services.switch_watch(task, watch, actor_id=request.user.id)
    except task_services.TaskActionError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"Now followed by {'streaming' if watch == 'stream' else 'polling'}.")
    return redirect("task-detail", pk=task.pk)
