"""Reading the mirror back as A2A JSON (for comparisons, exports and ``tasks show``)."""

from __future__ import annotations

from typing import Any

from tasks_app.models import Artifact, ConversationMessage, RemoteTask, TaskEvent


def task_view(task: RemoteTask, *, history: bool = True) -> dict[str, Any]:
    """The mirrored task in ProtoJSON ``Task`` form, as an agent's GetTask would show it."""
    status: dict[str, Any] = {"state": task.state or "TASK_STATE_UNSPECIFIED"}
    if task.status_message:
        status["message"] = task.status_message
    if task.status_timestamp:
        status["timestamp"] = task.status_timestamp.isoformat().replace("+00:00", "Z")
    view: dict[str, Any] = {"id": task.remote_id, "contextId": task.context_id, "status": status}
    artifacts = [
        artifact_json(a) for a in Artifact.objects.filter(task=task).prefetch_related("parts")
    ]
    if artifacts:
        view["artifacts"] = artifacts
    if history:
        messages = history_of(task)
        if messages:
            view["history"] = messages
    if task.metadata:
        view["metadata"] = task.metadata
    return view


def history_of(task: RemoteTask) -> list[dict[str, Any]]:
    """The conversation as an agent's GetTask shows it in ``history``.

    Normalizations (what an A2A 1.0 agent does, as the reference SDK does it):

    * the current status message is not in ``history`` (it is in
      ``status.message``; the agent moves it to ``history`` when the status
      changes again, which is when the mirror's next row arrives);
    * a message we sent is shown with the ``taskId`` and ``contextId`` the
      agent stamps on it when it takes the message.
    """
    current = (
        (task.status_message or {}).get("messageId")
        if isinstance(task.status_message, dict)
        else None
    )
    messages = []
    for stored in ConversationMessage.objects.filter(task=task):
        message = stored.message
        if current and message.get("messageId") == current:
            continue
        if task.remote_id and not message.get("taskId"):
            message = {**message, "taskId": task.remote_id}
        if task.context_id and not message.get("contextId"):
            message = {**message, "contextId": task.context_id}
        messages.append(message)
    return messages


def artifact_json(artifact: Artifact) -> dict[str, Any]:
    data: dict[str, Any] = {"artifactId": artifact.artifact_id}
    if artifact.name:
        data["name"] = artifact.name
    if artifact.description:
        data["description"] = artifact.description
    data["parts"] = [p.part for p in artifact.parts.all()]
    if artifact.metadata:
        data["metadata"] = artifact.metadata
    if artifact.extensions:
        data["extensions"] = artifact.extensions
    return data


def event_json(
    event: TaskEvent, received_at: str | None = None, *, with_raw: bool = True
) -> dict[str, Any]:
    """One log row as JSON: what ``tasks show``, the relay and websockets carry.

    Exports write ``exports.event_record`` instead (``state_after``, the actor's username
    and ``actor_id``, and the row's ``hash``).

    ``received_at``: the row's time as ``isoformat()`` writes it, when the caller has it
    (a batch's rows share one). ``with_raw`` False: ``raw`` is None (the row was read
    without it).
    """
    return {
        "task": event.task_id,
        "seq": event.seq,
        "received_at": received_at or event.received_at.isoformat(),
        "channel": event.channel,
        "kind": event.kind,
        "state": event.state_after,
        "note": event.note,
        "actor": event.actor_id,
        "raw": event.raw if with_raw else None,
    }


def task_document(task: RemoteTask) -> dict[str, Any]:
    """Snapshot, bookkeeping and the event log: what ``tasks show --json`` prints.

    The log is read up to the row's ``last_seq``: a row appended after the task was
    read (a settle, a late event) is left for the next look rather than shown with a
    snapshot that does not include it.
    """
    return {
        "pk": task.pk,
        "agent": {"id": task.agent_id, "name": task.agent.name, "base_url": task.agent.base_url},
        "phase": task.phase,
        "mode": task.mode,
        "watch": task.watch,
        "watcher_status": task.watcher_status,
        "watcher_note": task.watcher_note,
        "send_error": task.send_error,
        "last_seq": task.last_seq,
        "snapshot": task_view(task),
        "events": [
            event_json(e) for e in task.events.filter(seq__lte=task.last_seq).order_by("seq")
        ],
    }
