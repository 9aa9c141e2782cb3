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
    artifacts = [artifact_json(a) for a in Artifact.objects.filter(task=task).prefetch_related("parts")]
    if artifacts:
        view["artifacts"] = artifacts
    if history:
        messages = [m.message for m in ConversationMessage.objects.filter(task=task)]
        if messages:
            view["history"] = messages
    if task.metadata:
        view["metadata"] = task.metadata
    return view


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


def event_json(event: TaskEvent) -> dict[str, Any]:
    """One log row as JSON: what exports, ``tasks show``, the relay and websockets carry."""
    return {
        "task": event.task_id,
        "seq": event.seq,
        "received_at": event.received_at.isoformat(),
        "channel": event.channel,
        "kind": event.kind,
        "state": event.state_after,
        "note": event.note,
        "actor": event.actor_id,
        "raw": event.raw,
    }


def task_document(task: RemoteTask) -> dict[str, Any]:
    """Snapshot, bookkeeping and the whole event log: what ``tasks show --json`` prints."""
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
        "events": [event_json(e) for e in task.events.order_by("seq")],
    }
