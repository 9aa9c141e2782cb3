"""The task state machine and the fold of stream events into a task view.

Pure functions over plain ProtoJSON dicts, so the mirror can fold events from
any channel (send reply, stream, resubscribe, poll, push) the same way, and
replay a stored log to rebuild a snapshot.

The view
    A ProtoJSON ``Task`` dict, plus one reserved top-level key, ``"_fold"``
    (:data:`FOLD_KEY`), holding what the fold needs but the protocol has no
    field for: ``{"complete": [artifactId, ...]}`` -- artifacts whose last
    chunk arrived (``lastChunk: true``). Use :func:`task_json` to get the pure
    ProtoJSON Task and :func:`artifact_complete` to read the flag.

Rules (from the spec; the client never enforces transitions)
    * a ``task`` event is a snapshot: it **replaces** the view (artifacts and
      history come from it); completion flags survive for artifact ids still
      present, and all artifacts of a terminal task count as complete;
    * ``statusUpdate`` sets ``status``; with no view yet (a follow-up stream
      starts with a statusUpdate), a minimal view is built from taskId/contextId;
    * ``artifactUpdate`` with ``append: true`` extends the parts of the artifact
      with that id; otherwise it adds or replaces it; ``lastChunk: true`` marks
      it complete;
    * an event for another task id is a problem and changes nothing;
    * a status (or snapshot) whose ``status.timestamp`` is older than the
      view's is stale: reported and not applied;
    * illegal transitions (leaving a terminal state) and UNSPECIFIED/unknown
      states are reported, but the new state is still shown.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from .types import (
    ALL_STATES,
    STATE_AUTH_REQUIRED,
    STATE_CANCELED,
    STATE_COMPLETED,
    STATE_FAILED,
    STATE_INPUT_REQUIRED,
    STATE_REJECTED,
    STATE_SUBMITTED,
    STATE_UNSPECIFIED,
    STATE_WORKING,
    StreamEvent,
)

FOLD_KEY = "_fold"

TERMINAL_STATES = frozenset({STATE_COMPLETED, STATE_FAILED, STATE_CANCELED, STATE_REJECTED})
INTERRUPTED_STATES = frozenset({STATE_INPUT_REQUIRED, STATE_AUTH_REQUIRED})
ACTIVE_STATES = frozenset({STATE_SUBMITTED, STATE_WORKING})


def is_terminal(state: str | None) -> bool:
    return state in TERMINAL_STATES


def is_interrupted(state: str | None) -> bool:
    return state in INTERRUPTED_STATES


def is_active(state: str | None) -> bool:
    return state in ACTIVE_STATES


def transition_problem(old: str | None, new: str | None) -> str | None:
    """Describe what is wrong with moving from ``old`` to ``new`` (``None`` if fine).

    Reports, never raises: the caller still renders ``new``. ``old`` being
    ``None`` means "no state known yet".
    """
    if not new or new == STATE_UNSPECIFIED:
        return "task state is TASK_STATE_UNSPECIFIED (agent sent no state)"
    if new not in ALL_STATES:
        return f"unknown task state {new!r}"
    if old in TERMINAL_STATES and new != old:
        return f"illegal transition {old} -> {new}: terminal tasks are immutable"
    return None


@dataclass(slots=True)
class FoldResult:
    """The new view, what was odd about the event, and whether the view changed."""

    view: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    changed: bool = False

    @property
    def state(self) -> str | None:
        return state_of(self.view)


def state_of(view: dict[str, Any] | None) -> str | None:
    if not view:
        return None
    return (view.get("status") or {}).get("state") or STATE_UNSPECIFIED


def task_json(view: dict[str, Any]) -> dict[str, Any]:
    """The view without the fold's private key: a pure ProtoJSON Task."""
    return {k: v for k, v in view.items() if k != FOLD_KEY}


def artifact_complete(view: dict[str, Any], artifact_id: str) -> bool:
    return artifact_id in (view.get(FOLD_KEY) or {}).get("complete", [])


def artifact_text(artifact: dict[str, Any], sep: str = "") -> str:
    """Concatenated text parts of an artifact (or message)."""
    return sep.join(
        p["text"] for p in artifact.get("parts") or [] if isinstance(p.get("text"), str)
    )


def message_text(message: dict[str, Any] | None, sep: str = "\n") -> str:
    return artifact_text(message or {}, sep)


def parse_timestamp(value: Any) -> datetime | None:
    """RFC 3339 with or without fractional seconds; ``None`` when absent/unparsable."""
    if not isinstance(value, str) or not value:
        return None
    text = value.strip().replace("z", "Z")
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    # fromisoformat (3.11) accepts 1-6 fractional digits; trim nanoseconds.
    if "." in text:
        head, _, rest = text.partition(".")
        digits = "".join(ch for ch in rest if ch.isdigit())
        tz = rest[len(digits) :]
        text = f"{head}.{digits[:6].ljust(6, '0')}{tz}"
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def _stale(view: dict[str, Any] | None, status: dict[str, Any]) -> bool:
    if not view:
        return False
    old = parse_timestamp((view.get("status") or {}).get("timestamp"))
    new = parse_timestamp(status.get("timestamp"))
    return old is not None and new is not None and new < old


def _meta(view: dict[str, Any]) -> dict[str, Any]:
    meta = view.get(FOLD_KEY)
    if not isinstance(meta, dict):
        meta = {"complete": []}
        view[FOLD_KEY] = meta
    meta.setdefault("complete", [])
    return meta


def _as_event(event: StreamEvent | dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    if isinstance(event, StreamEvent):
        return event.kind, event.payload
    for kind in ("task", "message", "statusUpdate", "artifactUpdate"):
        if isinstance(event, dict) and isinstance(event.get(kind), dict):
            return kind, event[kind]
    return None


def _minimal_view(task_id: str, context_id: str | None) -> dict[str, Any]:
    view: dict[str, Any] = {"id": task_id, "status": {"state": STATE_UNSPECIFIED}}
    if context_id:
        view["contextId"] = context_id
    return view


def fold(view: dict[str, Any] | None, event: StreamEvent | dict[str, Any]) -> FoldResult:
    """Apply one event (a :class:`StreamEvent` or a StreamResponse dict) to ``view``.

    ``view`` is never mutated; the result holds a new dict when something changed.
    """
    parsed = _as_event(event)
    if parsed is None:
        return FoldResult(
            view, ["not a StreamResponse (no task/message/statusUpdate/artifactUpdate)"]
        )
    kind, payload = parsed
    problems: list[str] = []

    if kind == "task":
        task_id = payload.get("id")
        if view is not None and task_id != view.get("id"):
            return FoldResult(
                view, [f"snapshot of task {task_id!r} ignored: view is task {view.get('id')!r}"]
            )
        status = payload.get("status") or {}
        if _stale(view, status):
            return FoldResult(
                view,
                [
                    f"stale task snapshot ignored (status.timestamp {status.get('timestamp')} "
                    f"is older than {view['status'].get('timestamp')})"
                ],
            )  # type: ignore[index]
        problem = transition_problem(state_of(view), status.get("state"))
        if problem:
            problems.append(problem)
        new = copy.deepcopy(payload)
        new.pop(FOLD_KEY, None)
        old_complete = set((view or {}).get(FOLD_KEY, {}).get("complete", []))
        ids = [a.get("artifactId") for a in new.get("artifacts") or [] if isinstance(a, dict)]
        if status.get("state") in TERMINAL_STATES:
            complete = [i for i in ids if i]
        else:
            complete = [i for i in ids if i in old_complete]
        new[FOLD_KEY] = {"complete": complete}
        return FoldResult(new, problems, changed=new != view)

    if kind == "message":
        task_id = payload.get("taskId")
        if view is None or not task_id:
            return FoldResult(view)  # a task-less Message reply: nothing to fold
        if task_id != view.get("id"):
            return FoldResult(
                view, [f"message for task {task_id!r} ignored: view is task {view.get('id')!r}"]
            )
        history = view.get("history") or []
        if any(
            m.get("messageId") == payload.get("messageId") for m in history if isinstance(m, dict)
        ):
            return FoldResult(view)
        new = copy.deepcopy(view)
        new.setdefault("history", []).append(copy.deepcopy(payload))
        return FoldResult(new, changed=True)

    task_id = payload.get("taskId")
    if not task_id:
        return FoldResult(view, [f"{kind} without taskId ignored"])
    if view is not None and task_id != view.get("id"):
        return FoldResult(
            view, [f"{kind} for task {task_id!r} ignored: view is task {view.get('id')!r}"]
        )
    base = (
        copy.deepcopy(view)
        if view is not None
        else _minimal_view(task_id, payload.get("contextId"))
    )
    if (
        view is not None
        and payload.get("contextId")
        and view.get("contextId") not in (None, payload["contextId"])
    ):
        problems.append(
            f"{kind} contextId {payload['contextId']!r} differs from the task's {view.get('contextId')!r}"
        )
    if view is not None and not view.get("contextId") and payload.get("contextId"):
        base["contextId"] = payload["contextId"]

    if kind == "statusUpdate":
        status = payload.get("status") or {}
        if _stale(view, status):
            return FoldResult(
                view,
                [
                    f"stale status ignored ({status.get('state')} at {status.get('timestamp')} is "
                    f"older than {view['status'].get('timestamp')})"
                ],
            )  # type: ignore[index]
        problem = transition_problem(state_of(view), status.get("state"))
        if problem:
            problems.append(problem)
        base["status"] = copy.deepcopy(status)
        if not base["status"].get("state"):
            base["status"]["state"] = STATE_UNSPECIFIED
        return FoldResult(base, problems, changed=base != view)

    # artifactUpdate
    art = payload.get("artifact") or {}
    art_id = art.get("artifactId")
    if not art_id:
        return FoldResult(view, ["artifactUpdate without artifactId ignored"])
    if state_of(view) in TERMINAL_STATES:
        problems.append(f"artifact {art_id!r} updated after the task became {state_of(view)}")
    artifacts: list[dict[str, Any]] = base.setdefault("artifacts", [])
    index = next((i for i, a in enumerate(artifacts) if a.get("artifactId") == art_id), None)
    meta = _meta(base)
    if payload.get("append"):
        if index is None:
            problems.append(f"append to unknown artifact {art_id!r}: treated as a new artifact")
            artifacts.append(copy.deepcopy(art))
        else:
            if art_id in meta["complete"]:
                problems.append(f"append to artifact {art_id!r} after its last chunk")
            target = artifacts[index]
            target.setdefault("parts", []).extend(copy.deepcopy(art.get("parts") or []))
            for key in ("name", "description", "metadata", "extensions"):
                if key in art:
                    target[key] = copy.deepcopy(art[key])
    else:
        if index is None:
            artifacts.append(copy.deepcopy(art))
        else:
            artifacts[index] = copy.deepcopy(art)
        if art_id in meta["complete"]:
            meta["complete"].remove(art_id)
    if payload.get("lastChunk") and art_id not in meta["complete"]:
        meta["complete"].append(art_id)
    return FoldResult(base, problems, changed=True)


def fold_all(
    events: list[StreamEvent | dict[str, Any]], view: dict[str, Any] | None = None
) -> FoldResult:
    """Fold a sequence of events; problems accumulate, ``changed`` if any changed."""
    problems: list[str] = []
    changed = False
    for ev in events:
        res = fold(view, ev)
        view = res.view
        problems.extend(res.problems)
        changed = changed or res.changed
    return FoldResult(view, problems, changed)
