"""Open sockets learn at once when what their person may read changes.

A socket checks access when it connects; a role taken away, a person made
inactive, a logout, a password changed or an agent moved to another project must
not leave it streaming what that person may no longer read until it happens to
reconnect. Whatever changes
access - the ``members`` command, the admin, a project deleted with its
memberships - saves or deletes these rows, so the rows' signals are where the
news starts: after the commit, each affected person's sockets (the group
``person-<id>``) are told, and check again (``tasks_app.consumers``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.db import transaction
from django.db.models.signals import post_delete, post_save, pre_save

from tasks_app import relay
from tasks_app.models import Agent, Membership

CHANGED = "access.changed"


def announce(user_pks: Iterable[int]) -> None:
    """After the commit, tell each person's open sockets to check their access again."""
    targets = sorted(set(user_pks))
    if targets:
        transaction.on_commit(
            lambda: relay.publish([(relay.person_group(pk), {"type": CHANGED}) for pk in targets])
        )


def _members_of(*project_pks: int | None) -> list[int]:
    chosen = [pk for pk in project_pks if pk is not None]
    return list(Membership.objects.filter(project_id__in=chosen).values_list("user_id", flat=True))


def _membership_saving(sender: Any, instance: Membership, **kwargs: Any) -> None:
    """Remember the person a membership belonged to: moved to another person (the admin), it
    takes the role away from the first, whose sockets streamed on until their next recheck."""
    if instance.pk is not None:
        instance._user_before = (  # type: ignore[attr-defined]
            Membership.objects.filter(pk=instance.pk).values_list("user_id", flat=True).first()
        )


def _membership_changed(sender: Any, instance: Membership, **kwargs: Any) -> None:
    before = getattr(instance, "_user_before", None)
    announce([instance.user_id] + ([before] if before is not None else []))


def _person_saved(sender: Any, instance: Any, update_fields: Any = None, **kwargs: Any) -> None:
    if update_fields is not None and set(update_fields) <= {"last_login"}:
        return  # a login changes nothing anyone may read
    announce([instance.pk])


def _person_deleted(sender: Any, instance: Any, **kwargs: Any) -> None:
    announce([instance.pk])


def _logged_out(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    """A logout ends the session, and the sockets opened on it must close: the session is
    ended here, before they are told (``logout`` sends this signal first and flushes the
    session after, so sockets checking at once found it still there), then they check."""
    if user is None:
        return
    request.session.flush()
    announce([user.pk])


def _agent_saving(sender: Any, instance: Agent, update_fields: Any = None, **kwargs: Any) -> None:
    """Remember the project an agent is leaving (its old members may lose its tasks)."""
    if instance.pk is None or (update_fields is not None and "project" not in update_fields):
        return
    instance._project_before = (  # type: ignore[attr-defined]
        Agent.objects.filter(pk=instance.pk).values_list("project_id", flat=True).first()
    )


def _agent_saved(sender: Any, instance: Agent, created: bool, **kwargs: Any) -> None:
    before = getattr(instance, "_project_before", None)
    if not created and before is not None and before != instance.project_id:
        announce(_members_of(before, instance.project_id))


def connect() -> None:
    """Hook the signals up (from the app's ``ready()``)."""
    pre_save.connect(_membership_saving, sender=Membership, dispatch_uid="access-membership-saving")
    post_save.connect(
        _membership_changed, sender=Membership, dispatch_uid="access-membership-saved"
    )
    post_delete.connect(
        _membership_changed, sender=Membership, dispatch_uid="access-membership-deleted"
    )
    post_save.connect(_person_saved, sender=get_user_model(), dispatch_uid="access-person-saved")
    # A person deleted: a superuser has no memberships whose deletion would tell the sockets.
    post_delete.connect(
        _person_deleted, sender=get_user_model(), dispatch_uid="access-person-deleted"
    )
    user_logged_out.connect(_logged_out, dispatch_uid="access-logged-out")
    pre_save.connect(_agent_saving, sender=Agent, dispatch_uid="access-agent-saving")
    post_save.connect(_agent_saved, sender=Agent, dispatch_uid="access-agent-saved")
