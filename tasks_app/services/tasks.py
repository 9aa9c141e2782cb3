"""Starting, canceling, refreshing and importing tasks; the watchers' leases.

Everything that changes a task's snapshot or log goes through ``record()``;
these functions add the operator's intent (an ``operator`` entry with the
actor) and talk to the agent through ``tasks_app.outbound``.
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tasks_app import outbound, relay
from tasks_app.a2a import (
    A2AError,
    TaskNotCancelableError,
    user_message,
)
from tasks_app.models import TERMINAL_STATES, Agent, OperatorAction, RemoteTask
from tasks_app.services.record import record, task_summary

log = logging.getLogger(__name__)

Mode = RemoteTask.Mode


class TaskActionError(Exception):
    """An operator action could not be done; the message says why in plain words."""


# Starting -----------------------------------------------------------------------------------


def resolve_mode(agent: Agent, mode: str, *, from_browser: bool) -> str:
    """``auto``: stream when the card allows and a person watches; else return at once and poll."""
    if mode == Mode.AUTO:
        return Mode.STREAM if agent.streaming and from_browser else Mode.RETURN_IMMEDIATELY
    if mode == Mode.STREAM and not agent.streaming:
        raise TaskActionError(f"{agent.name} does not declare streaming; choose another mode.")
    if mode not in (Mode.STREAM, Mode.RETURN_IMMEDIATELY, Mode.BLOCKING):
        raise TaskActionError(f"Unknown mode {mode!r}.")
    return mode


def watch_for(agent: Agent, mode: str) -> str:
    return RemoteTask.Watch.STREAM if mode == Mode.STREAM and agent.streaming else RemoteTask.Watch.POLL


def start_task(
    agent: Agent,
    text: str = "",
    *,
    mode: str = Mode.AUTO,
    data: Any = None,
    files: tuple[dict, ...] = (),
    from_browser: bool = False,
    actor_id: int | None = None,
    metadata: dict | None = None,
) -> RemoteTask:
    """Create the mirror row and hand the send to a watcher (which records what comes back)."""
    if not (text or data is not None or files):
        raise TaskActionError("A message needs text, data or a file.")
    if not agent.interface_url:
        raise TaskActionError(f"{agent.name} has no usable interface; refresh its card.")
    mode = resolve_mode(agent, mode, from_browser=from_browser)
    message = user_message(text or None, data=data, files=files)
    with transaction.atomic():
        task = RemoteTask.objects.create(
            agent=agent,
            title=(text or "(data)").strip().splitlines()[0][:300] if (text or "").strip() else "(data)",
            mode=mode,
            request={"message": message, "metadata": metadata or {}},
            outbox={"message": message, "metadata": metadata or {}},
            phase=RemoteTask.Phase.SENDING,
            watch=watch_for(agent, mode),
            started_by_id=actor_id,
        )
        OperatorAction.objects.create(
            task=task, agent=agent, actor_id=actor_id, action="start", payload={"mode": mode}
        )
        record(task, {"operator": {"action": "start", "mode": mode, "message": message}}, "operator", actor_id=actor_id)
        transaction.on_commit(lambda: dispatch(task.pk))
    return task


def retry_send(task: RemoteTask, *, actor_id: int | None = None) -> RemoteTask:
    """Send the same message again (same ``messageId``, so the agent can drop a duplicate)."""
    with transaction.atomic():
        won = RemoteTask.objects.filter(pk=task.pk, phase=RemoteTask.Phase.FAILED, remote_id="").update(
            phase=RemoteTask.Phase.SENDING, send_error="", send_attempted_at=None, outbox=task.request
        )
        if not won:
            raise TaskActionError("Only a send that failed before the agent named a task can be retried.")
        OperatorAction.objects.create(task=task, agent=task.agent, actor_id=actor_id, action="retry")
        record(task, {"operator": {"action": "retry", "messageId": task.request.get("message", {}).get("messageId")}}, "operator", actor_id=actor_id)
        transaction.on_commit(lambda: dispatch(task.pk))
    task.refresh_from_db()
    return task


class AnswerTaken(TaskActionError):
    """Someone else's answer to this question won; says who and when."""

    def __init__(self, message: str, *, by: str = "", at: Any = None) -> None:
        super().__init__(message)
        self.by, self.at = by, at


def answer_task(
    task: RemoteTask,
    text: str = "",
    *,
    data: Any = None,
    actor_id: int | None = None,
    question_seq: int | None = None,
) -> RemoteTask:
    """Answer an interrupted task: a new message with the same taskId and contextId.

    Exactly one answer per question: ``question_seq`` is the seq of the row
    that asked (``asked_seq``, carried by the form the person saw; the current
    question when not given). The answer is taken only by a compare-and-set on
    that question not being answered yet (``answered_seq < asked_seq``), so
    nothing the watcher does while sending (clearing the outbox before the
    agent's reply is recorded) reopens the question. A new question (the agent
    asks again) has a new seq.
    """
    if task.state not in ("TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"):
        raise TaskActionError("This task is not waiting for an answer.")
    asked = task.asked_seq if question_seq is None else question_seq
    message = user_message(text or None, data=data, task_id=task.remote_id, context_id=task.context_id or None)
    with transaction.atomic():
        won = RemoteTask.objects.filter(
            pk=task.pk,
            asked_seq=asked,
            answered_seq__lt=asked,
            state__in=("TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"),
        ).update(
            outbox={"message": message},
            send_attempted_at=None,
            answered_seq=asked,
            answered_by_id=actor_id,
            answered_at=timezone.now(),
        )
        if not won:
            raise _answer_refused(task.pk, asked)
        OperatorAction.objects.create(task=task, agent=task.agent, actor_id=actor_id, action="answer")
        record(task, {"operator": {"action": "answer", "question": asked, "message": message}}, "operator", actor_id=actor_id)
        transaction.on_commit(lambda: dispatch(task.pk))
    task.refresh_from_db()
    return task


def _answer_refused(task_pk: int, asked: int) -> TaskActionError:
    current = RemoteTask.objects.select_related("answered_by").filter(pk=task_pk).first()
    if current is None:
        return TaskActionError("This task no longer exists.")
    if current.answered_seq >= asked and current.answered_at is not None:
        who = current.answered_by.get_username() if current.answered_by else "a command-line user"
        when = timezone.localtime(current.answered_at).strftime("%Y-%m-%d %H:%M:%S %Z")
        return AnswerTaken(f"Already answered by {who} at {when}.", by=who, at=current.answered_at)
    return TaskActionError("The agent has asked something else since; read its new question.")


# Actions on a known task ---------------------------------------------------------------------


def cancel_task(task: RemoteTask, *, reason: str = "", actor_id: int | None = None) -> RemoteTask:
    """Ask the agent to cancel; record the request and the task it returns."""
    if not task.remote_id:
        raise TaskActionError("The agent has not named this task yet; there is nothing to cancel.")
    client_metadata = {"reason": reason} if reason else None
    agent = task.agent
    record(task, {"operator": {"action": "cancel", "reason": reason}}, "operator", actor_id=actor_id)
    try:
        result = outbound.run(
            lambda http: outbound.client_for(agent, http).cancel_task(task.remote_id, metadata=client_metadata)
        )
    except TaskNotCancelableError as exc:
        task.refresh_from_db()
        if task.state == "TASK_STATE_CANCELED":
            return task  # already canceled: cancel is idempotent in effect
        outcome = f"The agent will not cancel this task ({exc.code} {exc.reason or ''}): {exc.message}"
        _action(task, actor_id, "cancel", {"reason": reason}, outcome)
        raise TaskActionError(outcome) from exc
    except A2AError as exc:
        _action(task, actor_id, "cancel", {"reason": reason}, str(exc))
        raise TaskActionError(f"Cancel failed: {exc}") from exc
    _action(task, actor_id, "cancel", {"reason": reason}, "requested")
    record(task, {"task": result}, "operator", actor_id=actor_id)
    task.refresh_from_db()
    if not task.is_terminal:
        dispatch(task.pk)  # make sure a watcher sees it through
    return task


def refresh_task(task: RemoteTask, *, actor_id: int | None = None) -> RemoteTask:
    """GetTask now and record what it says."""
    if not task.remote_id:
        raise TaskActionError("The agent has not named this task yet.")
    agent = task.agent
    try:
        result = outbound.run(lambda http: outbound.client_for(agent, http).get_task(task.remote_id))
    except A2AError as exc:
        raise TaskActionError(f"Refresh failed: {exc}") from exc
    record(task, {"task": result}, "poll", actor_id=actor_id)
    task.refresh_from_db()
    return task


def _action(task: RemoteTask, actor_id: int | None, action: str, payload: dict, outcome: str) -> None:
    OperatorAction.objects.create(
        task=task, agent_id=task.agent_id, actor_id=actor_id, action=action, payload=payload, outcome=outcome[:500]
    )


# Watching: dispatch and leases ----------------------------------------------------------------


def dispatch(task_pk: int) -> None:
    """Ask a worker to watch the task; harmless if one already does (the lease decides)."""
    from tasks_app.watchers import watch

    try:
        watch.delay(task_pk)
    except Exception:  # the reconciler re-dispatches; a broker hiccup must not fail the action
        log.exception("could not dispatch a watcher for task %s", task_pk)


def watchable() -> Q:
    """Tasks a watcher should hold: something to send, or known and neither ended nor waiting."""
    return (
        Q(phase=RemoteTask.Phase.SENDING)
        | Q(phase=RemoteTask.Phase.TASK, outbox__isnull=False)
        | Q(phase=RemoteTask.Phase.TASK)
        & ~Q(state__in=[*TERMINAL_STATES, "TASK_STATE_INPUT_REQUIRED"])
        & ~Q(watch=RemoteTask.Watch.NONE)
    )


def acquire_lease(task_pk: int, owner: str) -> str | None:
    """Take the watch of a task by compare-and-set; None when someone else holds it."""
    now = timezone.now()
    token = uuid.uuid4().hex
    won = (
        RemoteTask.objects.filter(pk=task_pk)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
        .update(
            lease_token=token,
            lease_owner=owner[:200],
            lease_expires_at=now + timedelta(seconds=settings.WATCH_LEASE_SECONDS),
        )
    )
    return token if won else None


def renew_leases(tokens: set[str]) -> set[str]:
    """Extend every lease this process holds; returns the tokens still ours."""
    if not tokens:
        return set()
    until = timezone.now() + timedelta(seconds=settings.WATCH_LEASE_SECONDS)
    RemoteTask.objects.filter(lease_token__in=tokens).update(lease_expires_at=until)
    return set(RemoteTask.objects.filter(lease_token__in=tokens).values_list("lease_token", flat=True))


def release_lease(
    task_pk: int,
    token: str,
    *,
    status: str = RemoteTask.WatcherStatus.IDLE,
    note: str = "",
    hold_off: float = 0,
) -> bool:
    """Give the watch up. ``hold_off`` keeps anyone (the reconciler too) from taking it for a while."""
    until = timezone.now() + timedelta(seconds=hold_off) if hold_off else None
    released = RemoteTask.objects.filter(pk=task_pk, lease_token=token).update(
        lease_token="", lease_owner="", lease_expires_at=until, watcher_status=status, watcher_note=note[:500]
    )
    if released:
        _relay_watcher(task_pk)
    return bool(released)


def set_watcher_status(task_pk: int, token: str, status: str, note: str = "") -> bool:
    """Change how the task is being watched, if we still hold it (and only if it differs)."""
    changed = (
        RemoteTask.objects.filter(pk=task_pk, lease_token=token)
        .exclude(watcher_status=status, watcher_note=note[:500])
        .update(watcher_status=status, watcher_note=note[:500])
    )
    if changed:
        _relay_watcher(task_pk)
    return RemoteTask.objects.filter(pk=task_pk, lease_token=token).exists() if not changed else True


def _relay_watcher(task_pk: int) -> None:
    task = RemoteTask.objects.filter(pk=task_pk).first()
    if task is None:
        return
    summary = task_summary(task)
    relay.publish(
        [
            (relay.task_group(task_pk), {"type": "task.watcher", **summary, "watcher_note": task.watcher_note}),
            (relay.LIST_GROUP, {"type": "tasks.changed", **summary}),
        ]
    )


def mark_send_attempted(task_pk: int, token: str) -> bool:
    """Note that the outbox is being sent; False if the lease is no longer ours."""
    return bool(
        RemoteTask.objects.filter(pk=task_pk, lease_token=token).update(send_attempted_at=timezone.now())
    )


def clear_outbox(task_pk: int, message_id: str) -> None:
    """The agent acknowledged the message: it must not be sent again."""
    task = RemoteTask.objects.filter(pk=task_pk).only("outbox").first()
    if task and task.outbox and task.outbox.get("message", {}).get("messageId") == message_id:
        RemoteTask.objects.filter(pk=task_pk, outbox__isnull=False).update(outbox=None)


def fail_send(task_pk: int, reason: str) -> None:
    """The send failed before the agent named a task: say so; never retry blindly."""
    with transaction.atomic():
        won = RemoteTask.objects.filter(pk=task_pk, phase=RemoteTask.Phase.SENDING, remote_id="").update(
            phase=RemoteTask.Phase.FAILED, send_error=reason[:2000], outbox=None
        )
        if won:
            record(task_pk, {"system": {"event": "send-failed", "reason": reason[:2000]}}, "system")
