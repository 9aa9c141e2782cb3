"""A2UI surfaces, folded from the entries ``record()`` is recording (the one fold path).

``record()`` calls :func:`collect` after it has folded a batch of entries and before it
hands out seqs, and :meth:`SurfaceFold.write` after it has written the log rows, in the
same transaction. Surfaces are therefore derived from the log only, and a replay of the
log (``services/audit.py``) folds them again the same way.

Where A2UI messages are taken from (data parts marked A2UI, see ``tasks_app.a2a.a2ui``):
the agent's messages a row adds to the conversation (a reply, a status message, a
snapshot's history), the parts of an artifact update, and the artifacts a snapshot
changes. What the mirror already held appends no row, so it is not folded again.

A message that cannot be folded (fails its schema, breaks a bound, an unsupported
version) and a surface that cannot be rendered (a missing component, an unresolvable
data path) each add a ``protocol-error`` row right after the row that carried it, with
the reason; the surface keeps the reason in ``problem`` and the message in ``raw_json``.
The rest of the task folds as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tasks_app.a2a import a2ui
from tasks_app.models import Surface

if TYPE_CHECKING:
    from tasks_app.models import TaskEvent
    from tasks_app.services.record import _Fold, _Row

log = logging.getLogger(__name__)
AGENT_ROLES = ("ROLE_AGENT", "agent")
# The fields the fold determines; the action_* fields belong to the act service.
FOLDED = tuple(a2ui.new_surface("").keys())


def _agent_parts(messages: list[dict]) -> list[Any]:
    return [
        part
        for message in messages
        if message.get("role") in AGENT_ROLES
        for part in message.get("parts") or []
    ]


def _a2ui(parts: list[Any]) -> list[tuple[str, Any]]:
    """``(media type, message)`` for each A2UI message in the parts, in order."""
    return [
        (a2ui.part_media_type(part), message)
        for part in parts
        if a2ui.is_a2ui_part(part)
        for message in a2ui.messages_in_part(part)
    ]


def _diagnosis(surface_id: str | None, version: str | None, reason: str) -> dict[str, Any]:
    """The raw of a protocol-error row about an A2UI message (small: the message is in the row before)."""
    if surface_id is not None and len(surface_id) > a2ui.MAX_ID_CHARS:
        surface_id = surface_id[: a2ui.MAX_ID_CHARS] + "…"
    where = f"A2UI surface {surface_id!r}" if surface_id is not None else "A2UI"
    detail = {"surfaceId": surface_id, "version": version}
    return {"protocolError": {"message": f"{where}: {reason}", "a2ui": detail}}


@dataclass
class SurfaceFold:
    """The surfaces of one task as this batch leaves them, and which row changed each."""

    task_pk: int
    surfaces: dict[str, dict[str, Any]]
    pks: dict[str, int]
    stored: dict[str, dict[str, Any]]
    # How many surfaces the task has besides those read (for the bound per task).
    others: int = 0
    # surface id -> the row (by identity) that last changed it in this batch.
    changed_by: dict[str, _Row] = field(default_factory=dict)

    def write(self, events: list[TaskEvent], rows: list[_Row]) -> None:
        """Write the surfaces the batch changed, each with the seq of the row that changed it last."""
        seq_of = {id(row): event.seq for row, event in zip(rows, events, strict=True)}
        new = []
        for surface_id, row in self.changed_by.items():
            state = self.surfaces[surface_id]
            if state == self.stored.get(surface_id):
                continue  # changed and changed back within the batch
            values = {name: state[name] for name in FOLDED}
            seq = seq_of[id(row)]
            if surface_id in self.pks:
                # A new state of the surface: an action taken on the old one no longer applies.
                Surface.objects.filter(pk=self.pks[surface_id]).update(
                    **values,
                    updated_seq=seq,
                    action_seq=None,
                    action_by=None,
                    action_at=None,
                    action_name="",
                )
            else:
                new.append(
                    Surface(task_id=self.task_pk, surface_id=surface_id, updated_seq=seq, **values)
                )
        Surface.objects.bulk_create(new)

    @staticmethod
    def _within_component_budget(
        items: list[tuple[str, Any]], reasons: list[tuple[str | None, str | None, str]]
    ) -> list[tuple[str, Any]]:
        """The messages up to ``MAX_COMPONENTS`` components in all (each one is validated)."""
        total = 0
        for index, (_, message) in enumerate(items):
            body = (
                message.get("updateComponents") or message.get("surfaceUpdate")
                if isinstance(message, dict)
                else None
            )
            components = body.get("components") if isinstance(body, dict) else None
            total += len(components) if isinstance(components, list) else 0
            if total > a2ui.MAX_COMPONENTS:
                why = (
                    f"too large: more than {a2ui.MAX_COMPONENTS} components in one event; "
                    f"{len(items) - index} message(s) not folded"
                )
                reasons.append((a2ui.surface_id_of(message), None, why))
                return items[:index]
        return items

    def fold_row(
        self, row: _Row, items: list[tuple[str, Any]]
    ) -> list[tuple[str | None, str | None, str]]:
        """Apply one row's A2UI messages; the ``(surface, version, reason)`` of each diagnosis.

        A refused message is diagnosed each time. A surface that cannot be rendered is
        diagnosed once per row, after all its messages (a part's list is applied whole, and
        a state in the middle of it is not the agent's mistake), and only when its problem
        is new.
        """
        before = dict(self.surfaces)
        marks = {sid: (state["problem"], state["raw_json"]) for sid, state in before.items()}
        reasons: list[tuple[str | None, str | None, str]] = []
        touched: list[str] = []
        if len(items) > a2ui.MAX_MESSAGES_PER_EVENT:
            limit = a2ui.MAX_MESSAGES_PER_EVENT
            why = f"too large: {len(items)} messages in one event (at most {limit}); the rest is not folded"
            reasons.append((None, None, why))
            items = items[:limit]
        items = self._within_component_budget(items, reasons)
        for media, message in items:
            surface_id = a2ui.surface_id_of(message)
            version = a2ui.message_version(message, media)
            if version is None:
                said = message.get("version") if isinstance(message, dict) else None
                reason = (
                    f"unsupported A2UI version {str(said)[:40]!r}"
                    if said is not None
                    else "not an A2UI message this dashboard knows"
                )
                if surface_id is not None and len(surface_id) > a2ui.MAX_ID_CHARS:
                    surface_id = None
                reasons.append((surface_id, None, reason))
                if surface_id is not None and (
                    surface_id in self.surfaces
                    or len(self.surfaces) + self.others < a2ui.MAX_SURFACES
                ):
                    state = self.surfaces.setdefault(
                        surface_id, a2ui.new_surface(str(said or "").lstrip("v")[:20])
                    )
                    state["problem"], state["raw_json"] = reason, a2ui.kept_raw(message)
                    touched.append(surface_id)
                continue
            outcome = a2ui.apply(self.surfaces, version, message, others=self.others)
            if outcome.surface_id is not None and outcome.surface_id in self.surfaces:
                touched.append(outcome.surface_id)
            if not outcome.applied and outcome.problem:
                reasons.append((outcome.surface_id, version, outcome.problem))
        for surface_id in dict.fromkeys(touched):
            state, old = self.surfaces[surface_id], before.get(surface_id)
            if old is None:
                changed = True
            elif state is old:  # a refusal marks the problem in place
                changed = marks[surface_id] != (state["problem"], state["raw_json"])
            else:  # apply() replaces what it changes, the old state stays as it was
                changed = state != old
            if changed:
                self.changed_by[surface_id] = row
            problem = state["problem"]
            already = any(sid == surface_id and reason == problem for sid, _, reason in reasons)
            old_problem = marks[surface_id][0] if surface_id in marks else ""
            if problem and problem != old_problem and not already:
                reasons.append((surface_id, state["version"], problem))
        return _few(reasons)


def _few(
    reasons: list[tuple[str | None, str | None, str]],
) -> list[tuple[str | None, str | None, str]]:
    """At most ``MAX_DIAGNOSES_PER_EVENT`` diagnoses for one row, the last counting the rest.

    Each refused message is diagnosed, and a row may carry 200: a 550-byte chunk of
    200 messages that are not A2UI wrote 201 rows, and under the events-per-second budget
    an agent could make ten thousand rows a second, none counted against the task's
    bytes. Each surface keeps its own problem (``Surface.problem``) whatever is listed.
    """
    limit = a2ui.MAX_DIAGNOSES_PER_EVENT
    if len(reasons) <= limit:
        return reasons
    rest = len(reasons) - (limit - 1)
    return [
        *reasons[: limit - 1],
        (
            None,
            None,
            f"{rest} more problems in this event, not listed (at most {limit} entries an event)",
        ),
    ]


def collect(fold: _Fold) -> SurfaceFold | None:
    """Fold the A2UI messages of the rows ``fold`` is about to append; None when there are none.

    Adds a ``protocol-error`` row after each row whose A2UI content could not be folded
    (unless the rows after it already are those very diagnoses: a replay of the log
    feeds them back, and they are not doubled).
    """
    from tasks_app.services.record import _Row, chain_digest, parse_entry

    rows = fold.rows
    found: list[tuple[int, list[tuple[str, Any]]]] = []
    held: dict[str, str] | None = None
    for index, row in enumerate(rows):
        if not row.apply:
            continue
        items = _a2ui(_agent_parts(getattr(row, "messages", [])))
        if row.kind == "artifactUpdate":
            update = row.entry.payload
            parts = update["artifact"].get("parts") or []
            items += _a2ui(parts)
            if held is not None:
                aid = update["artifact"]["artifactId"]
                start = held.get(aid, "") if update.get("append") else ""
                held[aid] = chain_digest(start, parts)
        elif row.kind == "task" and getattr(row, "replace_artifacts", False):
            artifacts = getattr(row, "artifacts", [])
            if held is None and any(_a2ui(a.get("parts") or []) for a in artifacts):
                held = {aid: a.digest for aid, a in fold.artifacts().items()}
                # The rows before this one changed some of them already.
                for earlier in rows[:index]:
                    if earlier.apply and earlier.kind == "artifactUpdate":
                        update = earlier.entry.payload
                        aid = update["artifact"]["artifactId"]
                        start = held.get(aid, "") if update.get("append") else ""
                        held[aid] = chain_digest(start, update["artifact"].get("parts") or [])
                    elif earlier.apply and getattr(earlier, "replace_artifacts", False):
                        held = {
                            a["artifactId"]: chain_digest("", a.get("parts") or [])
                            for a in getattr(earlier, "artifacts", [])
                        }
            if held is not None:
                wanted = {
                    a["artifactId"]: chain_digest("", a.get("parts") or []) for a in artifacts
                }
                for artifact in artifacts:
                    if held.get(artifact["artifactId"]) != wanted[artifact["artifactId"]]:
                        items += _a2ui(artifact.get("parts") or [])
                held = wanted
        if items:
            found.append((index, items))
    if not found:
        return None
    # Only the surfaces these messages name are read (a task may hold many big ones).
    named = {a2ui.surface_id_of(message) for _, items in found for _, message in items}
    existing = Surface.objects.filter(task_id=fold.task.pk)
    stored_rows = list(existing.filter(surface_id__in=named - {None}))
    stored = {s.surface_id: {name: getattr(s, name) for name in FOLDED} for s in stored_rows}
    result = SurfaceFold(
        task_pk=fold.task.pk,
        # apply() replaces what it changes; a refusal marks the top-level copy only.
        surfaces={sid: dict(state) for sid, state in stored.items()},
        pks={s.surface_id: s.pk for s in stored_rows},
        stored=stored,
        others=existing.count() - len(stored_rows),
    )
    inserted = 0
    for index, items in found:
        row = rows[index + inserted]
        try:
            reasons = result.fold_row(row, items)
        except Exception as exc:  # a fault of ours must not stop the task's record
            log.exception("A2UI fold failed for task %s", fold.task.pk)
            reasons = [(None, None, f"could not be folded ({type(exc).__name__})")]
        diagnoses = [parse_entry(_diagnosis(*reason)) for reason in reasons]
        at = index + inserted + 1
        # A replay brings the diagnoses back as the rows right after: take those, add none.
        following = rows[at : at + len(diagnoses)]
        if len(following) == len(diagnoses) and all(
            r.kind == "protocol-error" and r.entry.raw == d.raw
            for r, d in zip(following, diagnoses, strict=True)
        ):
            continue
        for offset, entry in enumerate(diagnoses):
            diagnosis = _Row(entry, "protocol-error", entry.note, apply=False)
            diagnosis.state_after = row.state_after
            list.insert(rows, at + offset, diagnosis)
        inserted += len(diagnoses)
    return result
