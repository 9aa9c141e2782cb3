"""Starting, canceling, refreshing and importing tasks; the watchers' leases.

Everything that changes a task's snapshot or log goes through ``record()``;
these functions add the operator's intent (an ``operator`` entry with the
actor) and talk to the agent through ``tasks_app.outbound``.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import models, transaction
from django.db.models import Case, F, Q, QuerySet, Value, When
from django.db.models.functions import Cast
from django.utils import timezone

from tasks_app import metrics, outbound, relay
from tasks_app.a2a import (
    A2AClient,
    A2AError,
    RemoteError,
    TaskNotCancelableError,
    TaskNotFoundError,
    a2ui,
    user_message,
)
from tasks_app.access import Perm, require
from tasks_app.models import TERMINAL_STATES, Agent, OperatorAction, RemoteTask, TaskEvent
from tasks_app.services import agents as agent_services
from tasks_app.services.record import record, settle, settle_if_ended, task_summary

log = logging.getLogger(__name__)

Mode = RemoteTask.Mode


class TaskActionError(Exception):
    """An operator action could not be done; the message says why in plain words."""


# Starting -----------------------------------------------------------------------------------


def resolve_mode(agent: Agent, mode: str, *, from_browser: bool) -> str:
    """``auto``: stream when the card allows and a person watches; push for work nobody
    watches (a command-line start) when the agent declares push and ``PUBLIC_URL`` is set;
    else return at once and poll."""
    from tasks_app.services.push import unavailable_reason

    if mode == Mode.AUTO:
        if agent.streaming and from_browser:
            return Mode.STREAM
        return (
            Mode.PUSH
            if not from_browser and not unavailable_reason(agent)
            else Mode.RETURN_IMMEDIATELY
        )
    if mode == Mode.STREAM and not agent.streaming:
        raise TaskActionError(f"{agent.name} does not declare streaming; choose another mode.")
    if mode == Mode.PUSH and unavailable_reason(agent):
        raise TaskActionError(unavailable_reason(agent))
    if mode not in (Mode.STREAM, Mode.RETURN_IMMEDIATELY, Mode.BLOCKING, Mode.PUSH):
        raise TaskActionError(f"Unknown mode {mode!r}.")
    return mode


def watch_for(agent: Agent, mode: str) -> str:
    if mode == Mode.PUSH:
        return RemoteTask.Watch.PUSH
    return (
        RemoteTask.Watch.STREAM
        if mode == Mode.STREAM and agent.streaming
        else RemoteTask.Watch.POLL
    )


_RETIRED = "{name} is retired: no task can be started on it."


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
    """Create the mirror row and hand the send to a watcher (which records what comes back).

    The message carries a ``contextId`` chosen here (a fresh UUID) and a stored
    ``messageId``: if the reply to the send is lost, ``ListTasks`` by that
    context finds the task the agent created, instead of a blind second send. An agent
    that refused such a contextId (``Agent.takes_client_context``, see
    :func:`send_without_context`) gets none: a lost reply's fate is then unknown.
    """
    require(actor_id, agent.project_id, Perm.OPERATE)
    if not ((text and text.strip()) or data is not None or files):
        # Spaces alone are no text (the form strips them; the command line did not).
        raise TaskActionError("A message needs text, data or a file.")
    if agent.retired_at is not None:
        raise TaskActionError(_RETIRED.format(name=agent.name))
    if not agent.interface_url:
        raise TaskActionError(f"{agent.name} has no usable interface; refresh its card.")
    mode = resolve_mode(agent, mode, from_browser=from_browser)
    context_id = str(uuid.uuid4()) if agent.takes_client_context else None
    message = user_message(text or None, data=data, files=files, context_id=context_id)
    message = a2ui.with_capabilities(message, a2ui.declared_version(agent.card))
    with transaction.atomic():
        if not agent_services.hold_in_service(agent.pk):  # retired since it was read
            raise TaskActionError(_RETIRED.format(name=agent.name))
        task = RemoteTask.objects.create(
            agent=agent,
            title=(text or "(data)").strip().splitlines()[0][:300]
            if (text or "").strip()
            else "(data)",
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
        record(
            task,
            {"operator": {"action": "start", "mode": mode, "message": message}},
            "operator",
            actor_id=actor_id,
        )
        # Whether a worker was asked (False: the broker refused; the reconciler asks later).
        transaction.on_commit(lambda: setattr(task, "handed_off", dispatch(task.pk)))
    return task


def can_retry(task: RemoteTask) -> bool:
    """A send may be repeated only when the agent is known not to have the task.

    ``fail_send`` clears ``send_attempted_at`` when that is known (nothing
    reached the agent, or ``ListTasks`` by our contextId found nothing); a send
    whose fate is unknown keeps it, and offers refresh (look again) instead.
    """
    return (
        task.phase == RemoteTask.Phase.FAILED
        and not task.remote_id
        and task.send_attempted_at is None
        and task.abandoned_at is None
    )


def offered_actions(task: RemoteTask) -> dict[str, bool]:
    """Which actions the task page offers now. Every phase has a way out: refresh and abandon
    for anything unfinished, cancel once named. The services refuse cancel and refresh
    outside them too (the command line reaches them without the page)."""
    unfinished = not task.is_terminal and task.phase != RemoteTask.Phase.MESSAGE
    lookup = (
        task.phase in (RemoteTask.Phase.SENDING, RemoteTask.Phase.FAILED) and not task.remote_id
    )
    open_ = task.abandoned_at is None
    # Abandoned is "not watched here", not "ended at the agent": a task abandoned while it
    # ran, or while its send may have landed, can still be looked up and canceled there
    # (it was offered nothing, and the agent's task ran on out of reach).
    sent = open_ or task.send_attempted_at is not None
    if task.agent.retired_at is not None:  # nothing is sent to it: no action can work
        return dict.fromkeys(_ACTIONS, False)
    return {
        # A task not named yet is looked up by its contextId first (services.tasks._name_task).
        "can_cancel": unfinished
        and (bool(task.remote_id) or (sent and task.phase == RemoteTask.Phase.SENDING)),
        "can_retry": can_retry(task),
        "can_refresh": bool(task.remote_id) or (sent and lookup),
        "can_abandon": open_ and unfinished,
        # A send parked before it went out (credentials withheld, say) too.
        "can_watch_again": open_
        and (bool(task.remote_id) or task.phase == RemoteTask.Phase.SENDING)
        and unfinished
        and task.gone_at is None
        and (
            task.watcher_status in (RemoteTask.WatcherStatus.PARKED, RemoteTask.WatcherStatus.LOST)
            # Backing off between turns (no holder, a hold-off of up to
            # WATCH_BACKOFF_MAX_SECONDS): "watch again" is "try now". A holder sleeping out
            # its backoff inside a turn keeps the lease, and the service would refuse.
            or (
                task.watcher_status == RemoteTask.WatcherStatus.RECONNECTING
                and not task.lease_token
            )
        ),
        # Follow by streaming or polling instead (``switch_watch``, which checks it again).
        "can_switch_from_push": task.watch == RemoteTask.Watch.PUSH
        and open_
        and unfinished
        and task.gone_at is None,
    }


_ACTIONS = ("can_cancel", "can_retry", "can_refresh", "can_abandon", "can_watch_again",
            "can_switch_from_push")  # fmt: skip


def not_offered(task: RemoteTask, action: str) -> str:
    """Why the page does not offer ``action`` on ``task`` (see ``offered_actions``)."""
    if task.agent.retired_at is not None:
        return outbound.retired_note(task.agent)
    return NOT_OFFERED[action]


NOT_OFFERED = {
    "can_cancel": "This task cannot be canceled: it has ended, or has no task at the agent.",
    "can_refresh": "There is nothing to refresh: this exchange has no task at the agent.",
    "can_abandon": "Only an unfinished task can be abandoned.",
}


def retry_send(task: RemoteTask, *, actor_id: int | None = None) -> RemoteTask:
    """Send the same message again (same ``messageId``, so the agent can drop a duplicate)."""
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    with transaction.atomic():
        won = RemoteTask.objects.filter(
            pk=task.pk,
            phase=RemoteTask.Phase.FAILED,
            remote_id="",
            send_attempted_at__isnull=True,
            abandoned_at__isnull=True,
        ).update(
            phase=RemoteTask.Phase.SENDING,
            send_error="",
            send_attempted_at=None,
            outbox=task.request,
        )
        if not won:
            raise TaskActionError(
                "Only a send that failed, to an agent known not to have the task, can be retried "
                "(refresh looks the task up by its contextId)."
            )
        OperatorAction.objects.create(
            task=task, agent=task.agent, actor_id=actor_id, action="retry"
        )
        record(
            task,
            {
                "operator": {
                    "action": "retry",
                    "messageId": task.request.get("message", {}).get("messageId"),
                }
            },
            "operator",
            actor_id=actor_id,
        )
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
    files: tuple[dict, ...] = (),
    actor_id: int | None = None,
    question_seq: int | None = None,
    metadata: dict | None = None,
    action: str = "answer",
    payload: dict | None = None,
    logged: Callable[[dict], dict] | None = None,
) -> RemoteTask:
    """Answer an interrupted task: a new message with the same taskId and contextId.

    The message carries a text part (when ``text``), a data part (``data``: for a
    schema-driven answer, the object validated against the agent's schema; see
    ``tasks_app.answers``) and file parts (``files``: Part dicts with ``raw``).

    Exactly one answer per question: ``question_seq`` is the seq of the row
    that asked (``asked_seq``, carried by the form the person saw; the current
    question when not given). The answer is taken only by a compare-and-set on
    that question not being answered yet (``answered_seq < asked_seq``), so
    nothing the watcher does while sending (clearing the outbox before the
    agent's reply is recorded) reopens the question. A new question (the agent
    asks again) has a new seq.

    ``logged``: what the log keeps of the message, when that is not all of it (an A2UI
    form's password fields: the agent gets them, the log shows them hidden).
    """
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    if task.state not in ("TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"):
        raise _not_waiting(task, question_seq)
    if task.abandoned_at is not None:
        # Never watched again: nobody would send it (the A2UI action's claim rolls back too).
        raise TaskActionError("This task was abandoned; an answer would never be sent.")
    if task.gone_at is not None:
        raise TaskActionError(
            "The agent does not know this task any more (gone); refresh it before answering."
        )
    asked = task.asked_seq if question_seq is None else question_seq
    if not (text or data is not None or files):
        raise TaskActionError("An answer needs text, data or a file.")
    message = user_message(
        text or None,
        data=data,
        files=files,
        task_id=task.remote_id,
        context_id=task.context_id or None,
        metadata=metadata,
    )
    # As the client will send it (A2UI negotiation), so the log holds what was sent.
    message = a2ui.with_capabilities(message, a2ui.declared_version(task.agent.card))
    with transaction.atomic():
        won = RemoteTask.objects.filter(
            pk=task.pk,
            asked_seq=asked,
            answered_seq__lt=asked,
            state__in=("TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"),
            abandoned_at__isnull=True,
        ).update(
            outbox={"message": message},
            send_attempted_at=None,
            answered_seq=asked,
            answered_by_id=actor_id,
            answered_at=timezone.now(),
            answer_failed_at=None,
            # A hold-off with no holder (push silence, a parked recheck) would keep the
            # answer's watcher from the lease: a push-followed task's answer waited for as
            # long as the agent went on notifying (each notification moves it on).
            lease_expires_at=Case(
                When(lease_token="", then=Value(None)), default=F("lease_expires_at")
            ),
        )
        if not won:
            raise answer_refusal(task.pk, asked)
        OperatorAction.objects.create(
            task=task, agent=task.agent, actor_id=actor_id, action=action, payload=payload or {}
        )
        entry = {"action": action, "question": asked, "message": message}
        if logged is not None:
            entry["message"] = logged(message)
            entry["hidden"] = "values typed into password fields (sent to the agent, not kept)"
        record(task, {"operator": entry}, "operator", actor_id=actor_id)
        transaction.on_commit(lambda: dispatch(task.pk))
    task.refresh_from_db()
    return task


def _not_waiting(task: RemoteTask, question_seq: int | None) -> TaskActionError:
    """The task moved on. When the question the person saw was answered meanwhile (maybe
    why it moved on), who answered and when: the second person was told only that the task
    no longer waited, and the docs promise them the first one's name."""
    ended = f"This task is not waiting for an answer (it is {task.state_label.lower()})."
    if question_seq and task.answered_seq >= question_seq:
        taken = answer_refusal(task.pk, question_seq)
        if isinstance(taken, AnswerTaken):
            return AnswerTaken(f"{taken} {ended}", by=taken.by, at=taken.at)
    return TaskActionError(ended)


def answer_refusal(task_pk: int, asked: int) -> TaskActionError:
    current = RemoteTask.objects.select_related("answered_by").filter(pk=task_pk).first()
    if current is None:
        return TaskActionError("This task no longer exists.")
    if current.abandoned_at is not None:
        return TaskActionError("This task was abandoned; an answer would never be sent.")
    if current.answered_seq >= asked and current.answered_at is not None:
        who = current.answered_by.get_username() if current.answered_by else "a command-line user"
        when = timezone.localtime(current.answered_at).strftime("%Y-%m-%d %H:%M:%S %Z")
        return AnswerTaken(f"Already answered by {who} at {when}.", by=who, at=current.answered_at)
    return TaskActionError("The agent has asked something else since; read its new question.")


# Finding a task whose send reply was lost ---------------------------------------------------

_ID_IN_SNIPPET = re.compile(r'"id"\s*:\s*"([^"\\]{1,300})"')


@dataclass
class Lookup:
    """What looking for a sent message's task found: the task, known absence, or why unknown."""

    task: dict | None = None
    absent: bool = False
    problem: str = ""


def _history_ids(task: dict) -> set[str]:
    return {
        m.get("messageId")
        for m in task.get("history") or []
        if isinstance(m, dict) and isinstance(m.get("messageId"), str)
    }


async def find_sent_task(client: A2AClient, message: dict, *, hint: str = "") -> Lookup:
    """Find the task a sent message created: by an id seen in a broken reply, else by contextId.

    ``ListTasks`` filtered by the contextId this dashboard chose tells whether
    the agent has the task. An empty answer means it does not (a retry is then
    safe); an agent that cannot list, or answers nonsense, leaves it unknown.
    """
    context_id = message.get("contextId") or ""
    message_id = message.get("messageId") or ""
    candidates = list(dict.fromkeys(_ID_IN_SNIPPET.findall(hint or "")))[:3]
    for candidate in candidates:
        try:
            snapshot = await client.get_task(candidate)
        except A2AError:
            continue
        if (context_id and snapshot.get("contextId") == context_id) or message_id in _history_ids(
            snapshot
        ):
            return Lookup(task=snapshot)
    if not context_id:
        return Lookup(problem="the message carried no contextId to look it up by")
    try:
        listing = await client.list_tasks(context_id=context_id, page_size=20, history_length=5)
    except A2AError as exc:
        return Lookup(problem=f"ListTasks by contextId failed: {exc}")
    # An agent may ignore the filter: only tasks in our (fresh, unique) context count.
    ours = [
        t
        for t in listing.get("tasks") or []
        if isinstance(t, dict) and t.get("contextId") == context_id
    ]
    if not ours:
        if listing.get("nextPageToken"):
            return Lookup(
                problem="ListTasks ignored the contextId filter; the task may be on a later page"
            )
        return Lookup(absent=True)
    with_message = [t for t in ours if message_id and message_id in _history_ids(t)]
    return Lookup(task=(with_message or ours)[0])


def _lookup_now(task: RemoteTask) -> Lookup:
    message = (task.request or {}).get("message") or {}
    agent = task.agent
    try:
        return outbound.run(lambda http: find_sent_task(outbound.client_for(agent, http), message))
    except A2AError as exc:  # credentials withheld, say: the action says why, not a 500
        return Lookup(problem=str(exc))


# Actions on a known task ---------------------------------------------------------------------


def _name_task(task: RemoteTask, *, actor_id: int | None) -> RemoteTask:
    """A task the agent has not named to us: look it up by its contextId and adopt what is found."""
    if task.remote_id:
        return task
    if task.phase not in (RemoteTask.Phase.SENDING, RemoteTask.Phase.FAILED):
        raise TaskActionError("This exchange has no task at the agent.")
    found = _lookup_now(task)
    if found.task is None:
        if found.absent:
            if task.phase == RemoteTask.Phase.FAILED:
                # Known now: the agent does not have it, so a retry is safe.
                RemoteTask.objects.filter(
                    pk=task.pk, phase=RemoteTask.Phase.FAILED, remote_id=""
                ).update(send_attempted_at=None)
            raise TaskActionError(
                "The agent has no task for this message (looked up by its contextId)."
            )
        raise TaskActionError(
            f"The agent has not named this task yet, and looking it up failed: {found.problem}"
        )
    result = record(task, {"task": found.task}, "poll", actor_id=actor_id)
    if not RemoteTask.objects.filter(pk=task.pk).exclude(remote_id="").exists():
        # Refused by the fold (an id no column keeps, one another row mirrors): the log
        # says why; the task is still unnamed, and nothing can be asked of the agent by id.
        why = f" ({result.notes[-1]})" if result.notes else ""
        raise TaskActionError(
            f"The agent listed a task for this message that the mirror could not take{why}."
        )
    # The request was taken: it must not be sent again. Only the request (compare-and-set on
    # its message id): the lookup took up to a minute, and an answer given meanwhile to a
    # question the named task asked waits in the same outbox.
    request_id = ((task.request or {}).get("message") or {}).get("messageId", "")
    clear_outbox(task.pk, request_id)
    RemoteTask.objects.filter(pk=task.pk).exclude(remote_id="").update(send_error="")
    task.refresh_from_db()
    return task


def cancel_task(task: RemoteTask, *, reason: str = "", actor_id: int | None = None) -> RemoteTask:
    """Ask the agent to cancel; record the request and the task it returns.

    A task not yet named to us (a send under way, or whose reply was lost) is
    first looked up by its contextId, so cancel works in every phase.
    """
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    if not offered_actions(task)["can_cancel"]:  # before anything is written
        raise TaskActionError(not_offered(task, "can_cancel"))
    if not task.remote_id and withdraw_send(task, reason=reason, actor_id=actor_id):
        task.refresh_from_db()
        return task
    try:
        task = _name_task(task, actor_id=actor_id)
    except TaskActionError as exc:
        _action(task, actor_id, "cancel", {"reason": reason}, str(exc))
        raise
    client_metadata = {"reason": reason} if reason else None
    agent = task.agent
    with transaction.atomic():
        # Checked again in the write (compare-and-set): the task may have ended since the
        # check above read it, and its end (``settled``) must not be followed by the
        # operator's entry, nor the agent asked.
        if not RemoteTask.objects.filter(unfinished(), pk=task.pk).update(
            updated_at=timezone.now()
        ):
            raise TaskActionError(NOT_OFFERED["can_cancel"])
        record(
            task, {"operator": {"action": "cancel", "reason": reason}}, "operator",
            actor_id=actor_id,
        )  # fmt: skip
    try:
        result = outbound.run(
            lambda http: outbound.client_for(agent, http).cancel_task(
                task.remote_id, metadata=client_metadata
            )
        )
    except (TaskNotCancelableError, TaskNotFoundError) as exc:
        # Refused: the task may have ended already, canceled included, before the mirror
        # heard of it, and some agents answer TaskNotFound for a task that ended. GetTask
        # decides (recorded), not the row we hold; TaskNotFound there too: gone at the agent.
        agent_services.mark_reachable(agent.pk)  # an answer, even a refusal
        gone: TaskNotFoundError | None = None
        try:
            snapshot = outbound.run(
                lambda http: outbound.client_for(agent, http).get_task(task.remote_id)
            )
        except TaskNotFoundError as not_found:
            gone = not_found
            mark_gone(task.pk, None, str(not_found))
        except A2AError:
            pass
        else:
            record(task, {"task": snapshot}, "poll", actor_id=actor_id)
            settle_if_ended(task, snapshot, note="reconciled with the agent's GetTask (cancel)")
        task.refresh_from_db()
        if task.settled_at is not None:
            _forget_push_later(task.pk, "deleted when the task settled")
        if task.state == "TASK_STATE_CANCELED":
            _action(task, actor_id, "cancel", {"reason": reason}, "already canceled")
            return task  # already canceled: cancel is idempotent in effect
        # The error's own text: one line, bounded (the agent's message could be megabytes
        # of anything, shown on the page and kept in the session).
        if gone is not None:
            outcome = f"The agent does not know this task: gone at the agent. ({gone})"
        else:
            outcome = f"The agent will not cancel this task: {exc}"
        _action(task, actor_id, "cancel", {"reason": reason}, outcome)
        raise TaskActionError(outcome) from exc
    except A2AError as exc:
        _action(task, actor_id, "cancel", {"reason": reason}, str(exc))
        raise TaskActionError(f"Cancel failed: {exc}") from exc
    agent_services.mark_reachable(agent.pk)
    _action(task, actor_id, "cancel", {"reason": reason}, "requested")
    record(task, {"task": result}, "operator", actor_id=actor_id)
    settle_if_ended(task, result, note="reconciled with the agent's answer to CancelTask")
    task.refresh_from_db()
    if not task.is_terminal and task.abandoned_at is None:
        dispatch(task.pk)  # make sure a watcher sees it through
    elif task.settled_at is not None:
        _forget_push_later(task.pk, "deleted when the task settled")
    return task


def _forget_push_later(task_pk: int, note: str) -> None:
    from tasks_app.services import push  # push imports this module

    push.forget_later(task_pk, note)


def refresh_task(task: RemoteTask, *, actor_id: int | None = None) -> RemoteTask:
    """GetTask now and record what it says; a task not named yet is looked up by its contextId.

    A task the agent had forgotten ("gone") that it knows again is watched
    again; one it still does not know stays gone, and the message says so.
    """
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    if not offered_actions(task)["can_refresh"]:  # before anything is written
        raise TaskActionError(not_offered(task, "can_refresh"))
    record(task, {"operator": {"action": "refresh"}}, "operator", actor_id=actor_id)
    try:
        task = _refresh(task, actor_id=actor_id)
    except TaskActionError as exc:
        _action(task, actor_id, "refresh", {}, str(exc))
        raise
    _action(task, actor_id, "refresh", {}, f"refreshed: {task.state or task.phase}")
    return task


def _refresh(task: RemoteTask, *, actor_id: int | None) -> RemoteTask:
    if not task.remote_id:
        task = _name_task(task, actor_id=actor_id)
        if not task.is_terminal and task.abandoned_at is None:
            dispatch(task.pk)
        return task
    agent = task.agent
    try:
        result = outbound.run(
            lambda http: outbound.client_for(agent, http).get_task(task.remote_id)
        )
    except TaskNotFoundError as exc:
        agent_services.mark_reachable(agent.pk)
        if task.is_terminal:
            # Ended but never settled (its holder stopped between the end and the settling,
            # and an hour on it is no longer watched): nothing will settle it but this, and
            # unsettled it stayed unfinished for ever (never final, never pruned).
            unsettled = RemoteTask.objects.filter(pk=task.pk, settled_at__isnull=True).exists()
            if unsettled:
                settle(task, None, note="not reconciled: the agent no longer knows this task")
                _forget_push_later(task.pk, "deleted when the task settled")
            raise TaskActionError(
                f"The agent no longer knows this task (it had ended): {exc}"
                + ("; it is final now, as last seen." if unsettled else "")
            ) from exc
        mark_gone(task.pk, None, str(exc))
        raise TaskActionError(
            f"The agent does not know this task: gone at the agent. ({exc})"
        ) from exc
    except A2AError as exc:
        raise TaskActionError(f"Refresh failed: {exc}") from exc
    agent_services.mark_reachable(agent.pk)
    record(task, {"task": result}, "poll", actor_id=actor_id)
    settle_if_ended(task, result, note="reconciled with the agent's GetTask (refresh)")
    if RemoteTask.objects.filter(pk=task.pk, settled_at__isnull=False).exists():
        _forget_push_later(task.pk, "deleted when the task settled")
    # Gone, and known again: by compare-and-set, not by the row read before the GetTask (a
    # watcher may have marked it gone meanwhile).
    back = RemoteTask.objects.filter(
        pk=task.pk, gone_at__isnull=False, abandoned_at__isnull=True
    ).update(
        gone_at=None,
        watcher_status=RemoteTask.WatcherStatus.IDLE,
        watcher_note="the agent knows it again",
        watcher_since=timezone.now(),
        fruitless_turns=0,
    )
    if back:
        record(
            task,
            {"system": {"event": "found-again", "detail": "the agent knows this task again"}},
            "system",
        )
    task.refresh_from_db()
    if RemoteTask.objects.filter(watchable(), pk=task.pk).exists():
        dispatch(task.pk)
    return task


def _why_not_watched_again(task_pk: int) -> str:
    """The refusal of "watch again", as the task is now (one sentence said "being watched
    already, or gone or abandoned" for a completed task and a message reply too)."""
    task = RemoteTask.objects.filter(pk=task_pk).first()
    if task is None:
        return "This task no longer exists."
    if task.abandoned_at is not None:
        return "This task was abandoned: it is not watched again."
    if task.gone_at is not None:
        return "The agent no longer knows this task (gone): there is nothing to watch."
    if task.phase == RemoteTask.Phase.MESSAGE:
        return "The agent answered with a message, not a task: there is nothing to watch."
    if task.phase == RemoteTask.Phase.FAILED:
        return "The send failed: retry it, or refresh to look the task up at the agent."
    if task.state in TERMINAL_STATES:
        return "This task has ended: there is nothing more to watch."
    if task.lease_token and task.lease_expires_at and task.lease_expires_at >= timezone.now():
        return "A watcher holds this task now: it is being watched already."
    return "This task is being watched already (it is not parked, lost or reconnecting)."


def watch_again(task: RemoteTask, *, actor_id: int | None = None) -> RemoteTask:
    """An operator asks for a parked (or lost) task to be watched again, from a clean slate."""
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    with transaction.atomic():
        # Nobody holds it: no lease, or one that ran out (a "lost" task keeps the dead
        # worker's token until a watcher takes it, and one that is not watchable never is).
        free = Q(lease_token="") | Q(lease_expires_at__lt=timezone.now())
        # An idle task only while it has a fruitless series to forget: the update below leaves
        # it idle with none, so of two callers released together only one matches (both did,
        # and the log held two watch-again entries).
        statuses = Q(
            watcher_status__in=[
                RemoteTask.WatcherStatus.PARKED,
                RemoteTask.WatcherStatus.LOST,
                RemoteTask.WatcherStatus.RECONNECTING,
            ]
        ) | Q(watcher_status=RemoteTask.WatcherStatus.IDLE, fruitless_turns__gt=0)
        # Not ended (a task settled while parked kept its status), not a failed send: the
        # page offers neither, and an entry after the end would follow the task's last word.
        won = RemoteTask.objects.filter(
            free,
            statuses,
            unfinished(),
            ~Q(phase=RemoteTask.Phase.FAILED),
            pk=task.pk,
            abandoned_at__isnull=True,
            gone_at__isnull=True,
        ).update(
            fruitless_turns=0,
            lease_token="",
            lease_owner="",
            lease_expires_at=None,
            watcher_status=RemoteTask.WatcherStatus.IDLE,
            watcher_note="watch again asked",
            watcher_since=timezone.now(),
        )
        if not won:
            raise TaskActionError(_why_not_watched_again(task.pk))
        OperatorAction.objects.create(
            task=task, agent=task.agent, actor_id=actor_id, action="watch"
        )
        record(task, {"operator": {"action": "watch-again"}}, "operator", actor_id=actor_id)
        transaction.on_commit(lambda: dispatch(task.pk))
    task.refresh_from_db()
    return task


def unfinished() -> Q:
    """Tasks an operator can still act on as running: not ended, not a plain message reply.

    The page offers abandon and the switch of watch only for these (``offered_actions``);
    checked again in the compare-and-set, so a task that ends between the page's look and
    the write is not abandoned or switched after its end, with entries for both.
    """
    return ~Q(state__in=TERMINAL_STATES) & ~Q(phase=RemoteTask.Phase.MESSAGE)


def still_open() -> Q:
    """Tasks someone may still act on: unfinished, neither abandoned nor gone (the task
    list's "open"; an agent with any is not retired, ``agents.open_tasks``)."""
    return unfinished() & Q(abandoned_at__isnull=True, gone_at__isnull=True)


def switch_watch(
    task: RemoteTask, watch: str, *, actor_id: int | None = None, only_from: str | None = None
) -> RemoteTask:
    """An operator switches a task followed by push (or anything else) to streaming or polling.

    ``only_from``: switch only a task still followed that way (part of the compare-and-set).
    A caller that decided from what it read (the last push config deleted: poll) must not
    overwrite another operator's switch made since.

    The hold-off of "awaiting push" is lifted and a watcher dispatched at once; a running
    holder notices the new way at its next turn. The task's push configs are deleted first
    (at the agent, then here: ``push.forget_configs_now``): left in place, the agent went
    on pushing beside the stream, and a chunk pushed before the stream brought it was
    appended twice (the stream's chunks are all taken), with false gaps after. A
    notification already queued is recorded as any other: after the stream's copy it is
    the same chunk, before it the stream's snapshot holds it.
    """
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    if watch not in (RemoteTask.Watch.STREAM, RemoteTask.Watch.POLL):
        raise TaskActionError("Choose streaming or polling.")
    if watch == RemoteTask.Watch.STREAM and not task.agent.streaming:
        raise TaskActionError(f"{task.agent.name} does not declare streaming; choose polling.")
    with transaction.atomic():
        followed = {"watch": only_from} if only_from is not None else {}
        won = (
            RemoteTask.objects.filter(
                unfinished(), pk=task.pk, abandoned_at__isnull=True, gone_at__isnull=True,
                **followed,
            )
            .exclude(watch=watch)
            .update(watch=watch)
        )  # fmt: skip
        if not won:
            raise TaskActionError(
                "This task is followed that way already, has ended, or is not watched any more."
            )
        RemoteTask.objects.filter(pk=task.pk, lease_token="").exclude(
            watcher_status=RemoteTask.WatcherStatus.PARKED
        ).update(
            lease_expires_at=None,
            watcher_status=RemoteTask.WatcherStatus.IDLE,
            watcher_note=f"switched to {watch} by an operator",
            watcher_since=timezone.now(),
        )
        OperatorAction.objects.create(
            task=task,
            agent=task.agent,
            actor_id=actor_id,
            action="switch-watch",
            payload={"watch": watch},
        )
        record(
            task,
            {"operator": {"action": "switch-watch", "watch": watch}},
            "operator",
            actor_id=actor_id,
        )
    # The configs go before a watcher starts (at the agent, best effort, then here): deleted
    # after, the agent could push a chunk that the new stream brought as well.
    from tasks_app.services import push  # push imports this module

    push.forget_configs_now(task.pk, f"the task is followed by {watch} now (an operator switched)")
    transaction.on_commit(lambda: dispatch(task.pk))
    task.refresh_from_db()
    return task


def abandon_task(
    task: RemoteTask, *, reason: str = "", actor_id: int | None = None, actor_name: str = ""
) -> RemoteTask:
    """Give a task up locally: a final local state, never watched again (the agent is not told).

    Clearing the lease fences a running holder: its next write is refused and
    it stops quietly.
    """
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    now = timezone.now()
    who = actor_name or "an operator"
    with transaction.atomic():
        won = RemoteTask.objects.filter(unfinished(), pk=task.pk, abandoned_at__isnull=True).update(
            abandoned_at=now,
            outbox=None,
            lease_token="",
            lease_owner="",
            lease_expires_at=None,
            watcher_status=RemoteTask.WatcherStatus.ABANDONED,
            # Cut as a whole: a 150-character username and a long reason overran the column.
            watcher_note=(f"abandoned by {who}" + (f": {reason}" if reason else ""))[:500],
            watcher_since=now,
        )
        if not won:
            if RemoteTask.objects.filter(pk=task.pk, abandoned_at__isnull=False).exists():
                raise TaskActionError("This task was abandoned already.")
            raise TaskActionError("Only an unfinished task can be abandoned.")
        OperatorAction.objects.create(
            task=task,
            agent=task.agent,
            actor_id=actor_id,
            action="abandon",
            payload={"reason": reason},
        )
        record(
            task,
            {"operator": {"action": "abandon", "by": who, "reason": reason}},
            "operator",
            actor_id=actor_id,
        )
        transaction.on_commit(lambda: _relay_watcher(task.pk))
        _forget_push_later(task.pk, "deleted when the task was abandoned")
    task.refresh_from_db()
    return task


def _action(
    task: RemoteTask, actor_id: int | None, action: str, payload: dict, outcome: str
) -> None:
    OperatorAction.objects.create(
        task=task,
        agent_id=task.agent_id,
        actor_id=actor_id,
        action=action,
        payload=payload,
        outcome=outcome[:500],
    )


# Watching: dispatch and leases ----------------------------------------------------------------


def dispatch(task_pk: int) -> bool:
    """Ask a worker to watch the task; harmless if one already does (the lease decides).
    False when the broker did not take the message (the reconciler asks again later)."""
    from tasks_app.watchers import watch

    try:
        watch.delay(task_pk)
    except Exception as exc:  # a broker hiccup must not fail the action
        log.warning("could not dispatch a watcher for task %s: %s", task_pk, exc)
        return False
    return True


SETTLE_WITHIN_SECONDS = 3600


def watchable() -> Q:
    """Tasks a watcher should hold: something to send, or known and not ended.

    A task waiting for an answer is held only for a look (one GetTask) every
    ``WATCH_QUESTION_RECHECK_SECONDS``: its holder's turn ends with that hold-off (an
    answer clears it). Never looked at again, a question the agent had ended (timed out,
    canceled elsewhere) stayed in the inbox until someone refreshed it.

    Abandoned tasks and tasks the agent forgot ("gone") are never watched, whatever they
    hold: a gone task with an answer in its outbox matched the first clauses and was taken
    up again every reconcile tick (one GetTask each, for ever). A refresh that finds it
    again clears ``gone_at``, and the answer goes out then.
    """
    return (
        Q(phase=RemoteTask.Phase.SENDING)
        | Q(phase=RemoteTask.Phase.TASK, outbox__isnull=False)
        | Q(phase=RemoteTask.Phase.TASK)
        & ~Q(state__in=TERMINAL_STATES)
        & ~Q(watch=RemoteTask.Watch.NONE)
        # Ended but not settled (its holder stopped in between): one more turn settles it.
        # Only recent ones, so that tasks ended before settling existed are not all read again.
        | Q(
            phase=RemoteTask.Phase.TASK,
            state__in=TERMINAL_STATES,
            settled_at__isnull=True,
            last_event_at__gte=timezone.now() - timedelta(seconds=SETTLE_WITHIN_SECONDS),
        )
        & ~Q(watch=RemoteTask.Watch.NONE)
    ) & Q(abandoned_at__isnull=True, gone_at__isnull=True)


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


def acquire_leases(task_pks: list[int], owner: str) -> dict[int, str]:
    """``acquire_lease`` for several tasks in one transaction (one commit); returns the ones won.

    1. Lock the batch's unheld rows, skipping rows another transaction has locked (another
       worker's batch taking the same task, a late renewal): they are that writer's, and
       the next reconcile tick looks at them again. Never waiting on a lock, two batches
       that overlap in a different order cannot deadlock (they did, one lease at a time).
    2. Take each locked row's lease by the same compare-and-set as ``acquire_lease``.
    """
    now = timezone.now()
    won: dict[int, str] = {}
    with transaction.atomic():
        free = (
            RemoteTask.objects.select_for_update(skip_locked=True)
            .filter(pk__in=task_pks)
            .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
            .values_list("pk", flat=True)
        )
        for task_pk in sorted(free):
            token = acquire_lease(task_pk, owner)
            if token is not None:
                won[task_pk] = token
    return won


def locked_in_pk_order(rows: QuerySet[RemoteTask], *, skip_locked: bool = False) -> list[int]:
    """Lock ``rows`` in primary-key order and return their pks; call inside a transaction.

    A bulk UPDATE locks its rows in the order its scan meets them. Two of them over the
    same rows (a worker's lease renewal, the reconcile tick taking lapsed leases over) met
    them in opposite orders once PostgreSQL's synchronized scans started each at its own
    block, and one was aborted as a deadlock (reproduced with 40,000 tasks). Every bulk
    write over many watched rows locks them here first, in one order, then updates by pk.
    ``skip_locked`` passes over rows another transaction holds (the tick can leave them for
    the next one). A no-op lock on SQLite, which has one writer at a time anyway.
    """
    return list(
        rows.select_for_update(skip_locked=skip_locked).order_by("pk").values_list("pk", flat=True)
    )


def renew_leases(statuses: dict[str, str]) -> set[str]:
    """Extend every lease this process holds; returns the tokens still ours.

    ``statuses`` maps each token to its holder's watcher status. A lease that ran out while
    its holder went on (its renewals met a database outage) and that nobody took meanwhile is
    renewed like any other; but a reconcile tick may have marked the row ``lost`` in between.
    Its holder's status is written back (guarded by the token and ``lost``), or the row
    would say "lost" of a healthy stream until the holder's status next changes.
    """
    if not statuses:
        return set()
    now = timezone.now()
    until = now + timedelta(seconds=settings.WATCH_LEASE_SECONDS)
    with transaction.atomic():
        mine = locked_in_pk_order(RemoteTask.objects.filter(lease_token__in=statuses))
        RemoteTask.objects.filter(pk__in=mine).update(lease_expires_at=until)
    kept = set()
    lost = RemoteTask.WatcherStatus.LOST
    # A holder that has not read its row yet (idle) has no status of its own to give.
    unknown = (lost, RemoteTask.WatcherStatus.IDLE)
    for token, row_status in RemoteTask.objects.filter(lease_token__in=statuses).values_list(
        "lease_token", "watcher_status"
    ):
        kept.add(token)
        if row_status == lost and statuses[token] not in unknown:
            RemoteTask.objects.filter(lease_token=token, watcher_status=lost).update(
                watcher_status=statuses[token],
                watcher_note="its watcher answers again",
                watcher_since=now,
            )
    return kept


def _since(status: str) -> Case:
    """``watcher_since`` moves only when the status changes (a new note keeps it)."""
    return Case(
        When(~Q(watcher_status=status), then=Value(timezone.now())), default=F("watcher_since")
    )


def release_lease(
    task_pk: int,
    token: str,
    *,
    status: str = RemoteTask.WatcherStatus.IDLE,
    note: str = "",
    hold_off: float = 0,
    fruitless_turns: int | None = None,
) -> bool:
    """Give the watch up. ``hold_off`` keeps anyone (the reconciler too) from taking it for a
    while, unless the task has something to send: an answer committed while the holder
    still held the lease (which ``answer_task`` leaves alone) would wait out the hold-off."""
    until: Any = None
    if hold_off:
        until = Case(
            When(outbox__isnull=False, then=Cast(Value(None), models.DateTimeField())),
            default=Value(timezone.now() + timedelta(seconds=hold_off)),
        )
    extra = {} if fruitless_turns is None else {"fruitless_turns": fruitless_turns}
    released = RemoteTask.objects.filter(pk=task_pk, lease_token=token).update(
        lease_token="",
        lease_owner="",
        lease_expires_at=until,
        watcher_since=_since(status),
        watcher_status=status,
        watcher_note=note[:500],
        **extra,
    )
    if released:
        _relay_watcher(task_pk)
    return bool(released)


def set_watcher_status(task_pk: int, token: str, status: str, note: str = "") -> bool:
    """Change how the task is being watched, if we still hold it (and only if it differs)."""
    changed = (
        RemoteTask.objects.filter(pk=task_pk, lease_token=token)
        .exclude(watcher_status=status, watcher_note=note[:500])
        .update(watcher_since=_since(status), watcher_status=status, watcher_note=note[:500])
    )
    if changed:
        _relay_watcher(task_pk)
    return (
        RemoteTask.objects.filter(pk=task_pk, lease_token=token).exists() if not changed else True
    )


def set_fruitless(task_pk: int, token: str, turns: int) -> None:
    """Keep the count of fruitless turns in a row (it survives slices and workers)."""
    RemoteTask.objects.filter(pk=task_pk, lease_token=token).exclude(fruitless_turns=turns).update(
        fruitless_turns=turns
    )


def has_outbox(task_pk: int) -> bool:
    """Whether a message waits to be sent (checked often only while authorization is awaited)."""
    return RemoteTask.objects.filter(pk=task_pk, outbox__isnull=False).exists()


def mark_gone(task_pk: int, token: str | None, detail: str) -> bool:
    """The agent answered TaskNotFound for a task it had not finished: say so once; stop watching.

    ``token`` is the holder's lease (its entry is fenced by it); None for an operator's refresh.
    """
    now = timezone.now()
    with transaction.atomic():
        guard = {"lease_token": token} if token is not None else {}
        # An abandoned task stays abandoned (an operator's refresh may still ask the agent).
        won = RemoteTask.objects.filter(
            pk=task_pk, gone_at__isnull=True, abandoned_at__isnull=True, **guard
        ).update(
            gone_at=now,
            watcher_since=now,
            watcher_status=RemoteTask.WatcherStatus.GONE,
            watcher_note="gone at the agent",
        )
        if won:
            record(
                task_pk,
                {
                    "system": {
                        "event": "gone",
                        "detail": f"the agent no longer knows this task: {detail}"[:2000],
                    }
                },
                "system",
                fence=token,
            )
    if won:
        transaction.on_commit(lambda: _relay_watcher(task_pk))
    return bool(won)


def _relay_watcher(task_pk: int) -> None:
    """Tell the task page and the lists how the task is watched now."""
    task = RemoteTask.objects.filter(pk=task_pk).first()
    if task is None:
        return
    summary = task_summary(task)
    relay.publish(
        [
            (
                relay.task_group(task_pk),
                {
                    "type": "task.watcher",
                    **summary,
                    "watcher_note": task.watcher_note,
                    "watcher_since": task.watcher_since.isoformat() if task.watcher_since else None,
                },
            ),
            (relay.LIST_GROUP, {"type": "tasks.changed", **summary}),
        ]
    )


def mark_send_attempted(task_pk: int, token: str, message_id: str) -> bool | None:
    """Note that the outbox's message ``message_id`` is being sent.

    True: noted, send it. False: the outbox no longer holds it (an operator withdrew the
    send, see :func:`withdraw_send`): do not send. None: the lease is no longer ours.
    One compare-and-set, so a withdrawal and a send never both win.
    """
    holds = Q(outbox__message__messageId=message_id) if message_id else Q(outbox__isnull=False)
    if RemoteTask.objects.filter(holds, pk=task_pk, lease_token=token).update(
        send_attempted_at=timezone.now()
    ):
        return True
    return False if RemoteTask.objects.filter(pk=task_pk, lease_token=token).exists() else None


# The send error of a send an operator withdrew (not a failure: no alert is raised for it).
WITHDRAWN = "canceled before it was sent"


def withdraw_send(task: RemoteTask, *, reason: str, actor_id: int | None) -> bool:
    """Cancel a first send that has not started: the message never reaches the agent.

    A compare-and-set on the send not being attempted yet (the watcher's
    :func:`mark_send_attempted` is the other side): False when the send is under way,
    and then only the agent can cancel it, once it names the task. The exchange ends as a
    failed send, which can be retried (nothing reached the agent).
    """
    with transaction.atomic():
        withdrawn = RemoteTask.objects.filter(
            pk=task.pk,
            phase=RemoteTask.Phase.SENDING,
            remote_id="",
            send_attempted_at__isnull=True,
            outbox__isnull=False,
        ).update(outbox=None, phase=RemoteTask.Phase.FAILED, send_error=WITHDRAWN)
        if not withdrawn:
            return False
        record(task, {"operator": {"action": "cancel", "reason": reason}}, "operator",
               actor_id=actor_id)  # fmt: skip
        # A failed send as the log tells it (replay reads the phase from "send-failed").
        record(
            task,
            {"system": {"event": "send-failed", "withdrawn": True,
                        "detail": f"{WITHDRAWN}; the agent never got the message"}},
            "system",
        )  # fmt: skip
        _action(task, actor_id, "cancel", {"reason": reason}, "withdrawn before it was sent")
    return True


def answer_failed(task_pk: int, message_id: str) -> bool:
    """An answer the agent refused (or never got): not sent again, and its question open again.

    The answer's compare-and-set marked the question answered (``answered_seq = asked_seq``).
    Left so, the page offered no answer form, the inbox and the "question waiting" alert no
    longer counted it, and a person could only cancel. One guarded update reopens it, only
    while the outbox still holds this answer (``answered_seq`` then says "answered before
    this question"). False when the outbox held another message or none.
    """
    return bool(
        RemoteTask.objects.filter(
            pk=task_pk, outbox__message__messageId=message_id, answered_seq=F("asked_seq")
        )
        .exclude(asked_seq=0)
        .update(outbox=None, answered_seq=F("asked_seq") - 1, answer_failed_at=timezone.now())
    )


def clear_outbox(task_pk: int, message_id: str) -> bool:
    """The agent acknowledged the message: it must not be sent again.

    One compare-and-set on the message's id: a read and then an update cleared an answer a
    person gave in between (the first send's holder clears its request after the agent's
    question may already be on the page). False when the outbox held another message or none.
    """
    if not message_id:
        return False
    return bool(
        RemoteTask.objects.filter(pk=task_pk, outbox__message__messageId=message_id).update(
            outbox=None
        )
    )


def refused_reply(task_pk: int) -> str:
    """Why the agent's reply to the task's send named no task the mirror could take (the
    note of the protocol error it was logged as; empty: no reply was logged). A send that
    met one was said to be "interrupted before the agent answered" (an agent answering
    with a task id another row mirrors, say)."""
    attempted = (
        RemoteTask.objects.filter(pk=task_pk).values_list("send_attempted_at", flat=True).first()
    )
    if attempted is None:
        return ""
    refusal = (
        TaskEvent.objects.filter(
            task_id=task_pk,
            kind=TaskEvent.Kind.PROTOCOL_ERROR,
            channel__in=("send-response", "stream"),
            received_at__gte=attempted,
        )
        .order_by("-seq")
        .values_list("note", flat=True)
        .first()
    )
    return (refusal or "")[:300]


def refuses_our_context(exc: Exception, message: dict) -> bool:
    """Whether ``exc``, an agent's error answering the first send of ``message``, refuses
    the contextId this dashboard chose for it.

    A2A 1.0 (section 3.4.1): an agent that cannot take a client's contextId must refuse the
    request. No error code is given for it, so the error must name the context: any other
    refusal (a bad part, an unsupported mode) fails the send as before, and a message that
    carried no contextId cannot have been refused for one.
    """
    return (
        isinstance(exc, RemoteError)
        and bool(message.get("contextId"))
        and "context" in f"{exc.message} {exc.reason or ''}".lower()
    )


def send_without_context(task_pk: int, token: str, message: dict, reason: str) -> bool:
    """The agent refused the contextId chosen for the first send of ``message`` (and has no
    task for it): send the same message again without one, and no later send to that agent
    carries one (``Agent.takes_client_context``).

    1. One compare-and-set on the holder's lease, the phase and the outbox still holding
       this message with that contextId: the request and the outbox lose the contextId,
       and ``send_attempted_at`` is cleared (nothing was sent that the agent took).
    2. A ``context-refused`` entry says so; its fold clears the mirror's ``context_id``
       (the one chosen here, noted from the start entry), so that the agent's own is
       adopted when it names the task, and a replay of the log agrees.
    3. The agent is marked.

    False when the compare-and-set matched nothing (the lease moved on, the send was
    withdrawn or answered meanwhile): the caller's turn ends as it would have.
    """
    message_id, context_id = message.get("messageId") or "", message.get("contextId") or ""
    if not message_id or not context_id:
        return False
    without = {key: value for key, value in message.items() if key != "contextId"}
    held = RemoteTask.objects.filter(
        pk=task_pk,
        lease_token=token,
        phase=RemoteTask.Phase.SENDING,
        remote_id="",
        outbox__message__messageId=message_id,
        outbox__message__contextId=context_id,
    )
    with transaction.atomic():
        task = held.only("pk", "agent_id", "request", "outbox").first()
        if task is None:
            return False
        won = held.update(
            request={**(task.request or {}), "message": without},
            outbox={**(task.outbox or {}), "message": without},
            send_attempted_at=None,
        )
        if not won:
            return False
        record(
            task_pk,
            {"system": {"event": "context-refused", "detail": reason[:2000]}},
            "system",
            fence=token,
        )
        Agent.objects.filter(pk=task.agent_id).update(takes_client_context=False)
    return True


def fail_send(
    task_pk: int, reason: str, *, retry_safe: bool = False, fence: str | None = None
) -> None:
    """The send failed before the agent named a task: say so; never retry blindly.

    ``retry_safe``: the agent is known not to have the task (nothing reached
    it, or ListTasks by our contextId found nothing); only then is "Retry
    send" offered (``send_attempted_at`` is cleared to say so).
    """
    extra = {"send_attempted_at": None} if retry_safe else {}
    # Fenced like the record below: a holder whose lease moved on (an operator abandoned the
    # task) changed the phase while its send-failed entry was refused, and the stored phase
    # then differed from what the log replays to.
    guard = {"lease_token": fence} if fence is not None else {}
    with transaction.atomic():
        won = RemoteTask.objects.filter(
            pk=task_pk, phase=RemoteTask.Phase.SENDING, remote_id="", **guard
        ).update(phase=RemoteTask.Phase.FAILED, send_error=reason[:2000], outbox=None, **extra)
        if won:
            record(
                task_pk,
                {
                    "system": {
                        "event": "send-failed",
                        "reason": reason[:2000],
                        "retry_safe": retry_safe,
                    }
                },
                "system",
                fence=fence,
            )
            transaction.on_commit(lambda: metrics.count("send_failures"))


relay_watcher = _relay_watcher
