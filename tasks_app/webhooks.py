"""The push webhook (public: agents call it) and the task page's push-config views.

The webhook has no login and no CSRF token: an agent is not a browser. It is
authenticated per config instead (``tasks_app.services.push.accept``: the config's
token and ``Authorization`` credentials in constant time, a signed token when the
agent signs), and answers at once; recording happens in the worker.

Two doors to the same ``accept()``: under ASGI (daphne, ``dashboard/asgi.py``; and the
webhook part alone, ``dashboard/webhook_asgi.py`` on uvicorn) :class:`PushRoute` answers
``/push/<config_id>/`` before Django; the Django view
:func:`receive` serves the same URL elsewhere (the test client, a WSGI server).
Why the route: a sync Django view under ASGI runs on one thread at a time and pays
for the whole middleware stack (sessions, CSRF, messages, axes: none apply to an
agent); at a thousand deliveries a second that overhead was most of the cost.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from tasks_app import metrics
from tasks_app.access import Perm, get_task_for_user
from tasks_app.models import RemoteTask
from tasks_app.runtime.logs import FailureSpell
from tasks_app.services import push as push_services
from tasks_app.services import tasks as task_services

log = logging.getLogger(__name__)

PUSH_PATH = re.compile(r"/push/([^/]+)/")
Scope = dict[str, Any]


# Deliveries that could not be checked (Redis or the database unreachable): with them down,
# a traceback per delivery was a log line per request anyone on the network sent.
_unchecked = FailureSpell(
    log,
    "push webhook: a delivery could not be checked; further failures are counted until one "
    "is checked",
    "push webhook: deliveries are checked again: %d could not be over %.1f s",
)


def _source(request: HttpRequest) -> str:
    """The peer's address (a proxy in front must be configured to pass the real one)."""
    return str(request.META.get("REMOTE_ADDR") or "unknown")


@csrf_exempt
def receive(request: HttpRequest, config_id: str) -> HttpResponse:
    """One delivery: 202 once queued, 200 for a repeat, 4xx with a short reason otherwise."""
    if request.method != "POST":
        return JsonResponse(
            {"error": "POST a StreamResponse"}, status=405, headers={"Allow": "POST"}
        )
    limit = push_services.settings.PUSH_MAX_BODY_BYTES
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        declared = 0
    if declared > limit:
        metrics.count("webhook_rejections", status=413)
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
    headers = {"Retry-After": "1"} if verdict.status in (429, 503) else None
    if verdict.status >= 400:
        metrics.count("webhook_rejections", status=verdict.status)
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
        {
            "task": task,
            "listing": listing,
            "can_operate": _can_operate(request, task),
            "remembered_seconds": push_services.LISTING_REMEMBERED_SECONDS,
        },
    )


def _can_operate(request: HttpRequest, task: RemoteTask) -> bool:
    from tasks_app.access import can

    return can(request.user, task.agent.project_id)["operate"]


@login_required
@require_POST
def push_config_delete(request: HttpRequest, pk: int, config_id: str) -> HttpResponse:
    task = get_task_for_user(request, pk, Perm.OPERATE)
    try:
        refused = push_services.delete_config(task, config_id, actor_id=request.user.id)
    except task_services.TaskActionError as exc:
        messages.error(request, str(exc))
    else:
        if refused:
            messages.warning(
                request,
                "Push config deleted here (its notifications are refused from now on); the "
                f"agent did not delete it: {refused}",
            )
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
        how = "streaming" if watch == "stream" else "polling"
        if task.watcher_status == task.WatcherStatus.PARKED:
            # Parked stays parked (its hold-off too): the switch applies when it is watched again.
            messages.success(request, f"Will be followed by {how}: use Watch again to start now.")
        else:
            messages.success(request, f"Now followed by {how}.")
    return redirect("task-detail", pk=task.pk)


class PushRoute:
    """ASGI: ``/push/<config_id>/`` answered here, everything else handed to ``inner`` (Django).

    Same checks, same answers as :func:`receive` (``accept_async()`` is ``accept()``
    for an event loop: the same flow of checks, with the Redis work of concurrent
    deliveries batched into one round trip); the security headers that matter for a
    JSON answer to a machine are set here, as Django's middleware would.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            root = scope.get("root_path") or ""
            match = PUSH_PATH.fullmatch(
                path[len(root) :] if root and path.startswith(root) else path
            )
            if match is not None:
                await self.handle(match.group(1), scope, receive, send)
                return
        await self.inner(scope, receive, send)

    async def handle(self, config_id: str, scope: Scope, receive: Any, send: Any) -> None:
        if scope["method"] != "POST":
            await _answer(send, 405, {"error": "POST a StreamResponse"}, [(b"allow", b"POST")])
            return
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or []:
            headers[name] = (
                headers[name] + b"," + value if name in headers else value
            )  # as Django joins them
        limit = push_services.settings.PUSH_MAX_BODY_BYTES
        try:
            declared = int(headers.get(b"content-length") or 0)
        except ValueError:
            declared = 0
        if declared > limit:
            await _answer(send, 413, {"error": "body too large"})
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body") or b""
            size += len(chunk)
            if size > limit:
                await _answer(send, 413, {"error": "body too large"})
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        client = scope.get("client")
        try:
            verdict = await push_services.accept_async(
                config_id,
                body=b"".join(chunks),
                content_type=headers.get(b"content-type", b"").decode("latin-1"),
                authorization=headers.get(b"authorization", b"").decode("latin-1"),
                token=headers.get(b"x-a2a-notification-token", b"").decode("latin-1"),
                source=str(client[0]) if client else "unknown",
            )
        except Exception:  # Redis or the database unreachable: the agent retries later
            _unchecked.failed()
            await _answer(send, 503, {"error": "try again later"}, [(b"retry-after", b"5")])
            return
        _unchecked.worked()
        payload = {"status": verdict.reason} if verdict.accepted else {"error": verdict.reason}
        await _answer(
            send,
            verdict.status,
            payload,
            [(b"retry-after", b"1")] if verdict.status in (429, 503) else [],
        )


async def _answer(
    send: Any, status: int, payload: dict[str, str], extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    if status >= 400:
        metrics.count("webhook_rejections", status=status)  # a dict update; Redis gets it later
    body, headers = _encoded(*next(iter(payload.items())))
    if extra:
        headers = (*headers, *extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@functools.lru_cache(maxsize=256)
def _encoded(key: str, reason: str) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    """An answer's body and headers, made once per reason (the reasons are a short, fixed
    list of sentences, never request data): a thousand answers a second say the same."""
    body = json.dumps({key: reason}).encode()
    return body, (
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'"),
    )
