"""A person's action on an agent's A2UI surface, sent back on the same task.

A Button's ``action.event`` becomes the A2UI client-to-server message of the surface's
version (v0.8 ``userAction``, v0.9+ ``action``: the name, the surface, the source component,
the context resolved against the data model with the person's values) in a data part of a new
message on the same task and contextId. It goes through the answers' path
(``tasks.answer_task``: the outbox, the watcher, the operator entry in the log), with the
surface's data model in ``message.metadata.a2uiClientDataModel`` (v0.9+; v0.8 has none).

Exactly one action per surface state: the form carries the surface's ``updated_seq``; the
action is taken by a compare-and-set on ``updated_seq = seen and action_seq IS NULL``, in the
same transaction as the answer's own compare-and-set, so two people submitting at once yield
one message, and the other is told who submitted. A new surface state (the agent updated it)
has a new ``updated_seq``, so an ``action_seq`` below it belongs to an earlier state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from tasks_app import a2ui_render
from tasks_app.a2a import a2ui as protocol
from tasks_app.access import Forbidden, Perm, require
from tasks_app.models import RemoteTask, Surface
from tasks_app.redaction import hide_secrets
from tasks_app.services import tasks as task_services

log = logging.getLogger(__name__)


class ActionRefused(task_services.TaskActionError):
    """The action was not sent; ``errors`` holds failing checks per input/button (``v0``, ``b1``)."""

    def __init__(
        self, message: str, *, errors: dict[str, list[str]] | None = None, model: Any = None
    ) -> None:
        super().__init__(message)
        self.errors = errors or {}
        self.model = model  # the data model with the person's values, to draw them again


class AlreadySubmitted(ActionRefused):
    """Someone else's action on this surface state won."""


@dataclass
class Sent:
    task: RemoteTask
    surface: Surface
    message: dict


def act(
    user: Any,
    task: RemoteTask,
    surface_id: str,
    form_seq: int,
    source: str,
    values: Any,
) -> Sent:
    """Send the action of button ``source`` (``b<n>`` as the page drew it) of the surface
    state ``form_seq``, with ``values`` (the posted form: ``v<n>`` per input).

    Refused, with a plain message: the person may not operate; the surface is gone, has a
    problem, or changed since the form was drawn; someone already acted on it; a check fails.
    """
    if not getattr(user, "is_authenticated", False):
        # Its pk, None, would pass the services' check as the system's.
        raise Forbidden("Only a signed-in person may act on a form.")
    actor_id = user.pk
    require(actor_id, task.agent.project_id, Perm.OPERATE)
    surface = Surface.objects.filter(task=task, surface_id=surface_id).first()
    if surface is None or surface.deleted:
        raise ActionRefused("This form is no longer there; the agent removed it.")
    if surface.problem or not surface.ready:
        raise ActionRefused("This form could not be drawn, so it cannot be submitted.")
    if surface.action_seq == form_seq and surface.updated_seq == form_seq:
        raise _already(surface)
    if surface.updated_seq != form_seq:
        raise ActionRefused(
            "The agent changed this form since it was shown; review it and submit again."
        )
    try:
        model, walk = a2ui_render.apply_post(surface, values)
    except Exception as exc:  # the agent's components in a shape nothing draws: not sendable
        log.warning("surface %s of task %s could not be read back: %r", surface_id, task.pk, exc)
        raise ActionRefused("This form could not be drawn, so it cannot be submitted.") from exc
    button = next((b for b in walk.buttons if f"b{b.index}" == source), None)
    if button is None:
        raise ActionRefused("That button does not send anything.")
    errors = a2ui_render.errors_of(walk, model)
    if errors:
        raise ActionRefused(
            "Not sent: " + " ".join(m for msgs in errors.values() for m in msgs)[:400],
            errors=errors,
            model=a2ui_render.without_secret_inputs(walk, model),
        )
    name = a2ui_render.action_name(button)
    context = a2ui_render.resolve_context(button, model)
    message, part, metadata = _build(surface, name, button.component_id, context, model)
    # The agent gets what was typed into password fields; the log, the audit row and the
    # page keep the message with those values hidden.
    secrets = a2ui_render.secret_values(walk, model)
    now = timezone.now()
    with transaction.atomic():
        # The task's row first (the answer's compare-and-set), then the surface's claim: the
        # order record() takes them in when the agent changes the form. Taken the other way
        # round, on PostgreSQL an action and the agent's change of the same form each waited
        # for the other's row until one was aborted as a deadlock (the person got an error
        # page, or the watcher lost its batch). A claim refused rolls the answer back.
        try:
            task_services.answer_task(
                task,
                files=(part,),
                actor_id=actor_id,
                metadata=metadata,
                action="a2ui-action",
                payload={
                    "surface": surface_id,
                    "surface_seq": form_seq,
                    "name": name,
                    "source": button.component_id,
                    "context": hide_secrets(context, secrets),
                },
                logged=(lambda sent: hide_secrets(sent, secrets)) if secrets else None,
            )
        except task_services.AnswerTaken:
            # Someone's answer took the task's row first. When it was an action on this
            # very form, the person is told whose, as when the claim itself is refused.
            current = Surface.objects.select_related("action_by").filter(pk=surface.pk).first()
            if current is not None and current.action_seq == form_seq:
                raise _already(current) from None
            raise
        # ``action_seq`` below the state's seq is an action on an earlier state of the surface.
        won = Surface.objects.filter(
            Q(action_seq__isnull=True) | Q(action_seq__lt=form_seq),
            pk=surface.pk,
            updated_seq=form_seq,
            deleted=False,
        ).update(action_seq=form_seq, action_by_id=actor_id, action_at=now, action_name=name)
        if not won:
            raise _claim_refused(surface.pk, form_seq)
    surface.refresh_from_db()
    task.refresh_from_db()
    return Sent(task=task, surface=surface, message=hide_secrets(message, secrets))


def _claim_refused(surface_pk: int, form_seq: int) -> ActionRefused:
    """Why the claim on state ``form_seq`` was refused: the agent changed or removed the form
    since it was read (it was called "already submitted by a command-line user"), or
    someone's action on that state won."""
    current = Surface.objects.select_related("action_by").filter(pk=surface_pk).first()
    if current is None or current.deleted:
        return ActionRefused("This form is no longer there; the agent removed it.")
    if current.updated_seq != form_seq:
        return ActionRefused(
            "The agent changed this form since it was shown; review it and submit again."
        )
    return _already(current)


def _already(surface: Surface) -> AlreadySubmitted:
    who = surface.action_by.get_username() if surface.action_by else "a command-line user"
    when = (
        timezone.localtime(surface.action_at).strftime("%Y-%m-%d %H:%M:%S %Z")
        if surface.action_at
        else "an earlier time"
    )
    return AlreadySubmitted(f"Already submitted by {who} at {when}.")


def _build(
    surface: Surface, name: str, source_id: str, context: dict, model: dict
) -> tuple[dict, dict, dict]:
    """The client-to-server message, the data part that carries it, and the message metadata
    (v0.9+: the surface's data model with the person's values, ``a2uiClientDataModel``)."""
    message = protocol.action_message(
        surface.version,
        name=name,
        surface_id=surface.surface_id,
        source_component_id=source_id,
        context=context,  # resolved already (a2ui_render also evaluates function calls)
        data_model=model,
        timestamp=timezone.now(),
    )
    part = protocol.action_part(surface.version, message)
    metadata = protocol.action_metadata(surface.version, surface.surface_id, model)
    return message, part, metadata
