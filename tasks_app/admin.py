"""The mirror in Django's admin: read-only views for debugging.

The event log, the snapshot folded from it (tasks, artifacts, parts,
conversation) and the operator actions are append-only records: the admin may
view them, never add, change or delete them (the log's hash chain and
``audit replay`` would otherwise break). Agents stay editable. Credentials are
never shown (the encrypted field is excluded). It is for superusers only: it edits
across every project, outside the role table, and its changes write no operator action but
who may read what: who is a member of which project with which role, which the action log
keeps however it is changed (``member-add`` and ``member-remove``, as ``manage.py members``
writes them; a membership moved to another person or project, or a person deleted, takes a
role away), and who is a superuser (``superuser-add``, ``superuser-remove``).
"""

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin
from django.db import models
from django.http import HttpRequest

from tasks_app.actionlog import log_member_change, log_superuser_change
from tasks_app.models import (
    Agent,
    Artifact,
    ArtifactPart,
    ConversationMessage,
    Membership,
    OperatorAction,
    Project,
    RemoteTask,
    Surface,
    TaskEvent,
)


def _superusers_only(request: HttpRequest) -> bool:
    """Staff status and model permissions alone do not open the admin (see the docstring)."""
    return request.user.is_active and request.user.is_superuser


admin.site.has_permission = _superusers_only  # type: ignore[method-assign]


def _member_action(request: HttpRequest, membership: Membership, action: str) -> None:
    """A role given, changed or taken away here, in the action log as the command line writes
    it: a grant made in the admin left no trace an auditor could find."""
    role = membership.role if action == "member-add" else ""
    log_member_change(action, membership.user, membership.project, role, request.user.pk)


def _save_membership(request: HttpRequest, membership: Membership, *, changed: bool) -> None:
    """Save a membership added or changed here, and log what that gave and took away.

    A membership moved to another person or project takes the role away from the pair it
    held: logged as a grant alone, the log went on saying the first person held it (and
    the first person's open sockets went on streaming, see ``access_changes``).
    """
    before = None
    if membership.pk is not None:
        before = (
            Membership.objects.select_related("user", "project").filter(pk=membership.pk).first()
        )
    membership.save()
    if before is not None and (before.user_id, before.project_id) != (
        membership.user_id,
        membership.project_id,
    ):
        _member_action(request, before, "member-remove")
    if before is None or changed:
        _member_action(request, membership, "member-add")


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ("user",)


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    """Projects and who is in them with which role (also: ``manage.py members``)."""

    list_display = ("name", "created_at")
    search_fields = ("name",)
    inlines = [MembershipInline]

    def save_formset(self, request: HttpRequest, form, formset, change: bool) -> None:  # type: ignore[no-untyped-def]
        if formset.model is not Membership:
            super().save_formset(request, form, formset, change)
            return
        for membership in formset.save(commit=False):  # new and changed rows
            _save_membership(request, membership, changed=True)
        for membership in formset.deleted_objects:
            _member_action(request, membership, "member-remove")
            membership.delete()

    def delete_model(self, request: HttpRequest, obj: Project) -> None:
        self.delete_queryset(request, Project.objects.filter(pk=obj.pk))

    def delete_queryset(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        gone = Membership.objects.filter(project__in=queryset).select_related("user", "project")
        for membership in gone:
            _member_action(request, membership, "member-remove")
        super().delete_queryset(request, queryset)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ("user", "project", "role", "created_at")
    list_filter = ("role", "project")
    search_fields = ("user__username", "project__name")
    autocomplete_fields = ("user", "project")

    def save_model(self, request: HttpRequest, obj: Membership, form, change: bool) -> None:  # type: ignore[no-untyped-def]
        _save_membership(request, obj, changed=bool(form.changed_data))

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        _member_action(request, obj, "member-remove")
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        for membership in queryset.select_related("user", "project"):
            _member_action(request, membership, "member-remove")
        super().delete_queryset(request, queryset)


class PersonAdmin(UserAdmin):
    """Django's own user admin, with what it changes of who may read what in the action log.

    A person deleted takes their memberships along (a cascade): the log went on saying
    they held their roles. Superuser status opens every project, which no membership shows.
    """

    def save_model(self, request: HttpRequest, obj, form, change: bool) -> None:  # type: ignore[no-untyped-def]
        people = get_user_model().objects
        was = change and people.filter(pk=obj.pk, is_superuser=True).exists()
        super().save_model(request, obj, form, change)
        if obj.is_superuser != was:
            log_superuser_change(obj, granted=obj.is_superuser, actor_id=request.user.pk)

    def delete_model(self, request: HttpRequest, obj) -> None:  # type: ignore[no-untyped-def]
        self._log_leaving(request, get_user_model().objects.filter(pk=obj.pk))
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        self._log_leaving(request, queryset)
        super().delete_queryset(request, queryset)

    def _log_leaving(self, request: HttpRequest, people) -> None:  # type: ignore[no-untyped-def]
        held = Membership.objects.filter(user__in=people).select_related("user", "project")
        for membership in held:
            _member_action(request, membership, "member-remove")
        for person in people.filter(is_superuser=True):
            log_superuser_change(person, granted=False, actor_id=request.user.pk)


admin.site.unregister(get_user_model())
admin.site.register(get_user_model(), PersonAdmin)


@admin.register(Agent)
class AgentAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "project",
        "base_url",
        "binding",
        "streaming",
        "push",
        "reachable",
        "card_fetched_at",
        "retired_at",
    )
    list_filter = ("project", ("retired_at", admin.EmptyFieldListFilter))
    search_fields = ("name", "base_url")
    # Credentials and the origins they are approved for change only through the agent
    # page (which re-binds them); the admin never shows or edits them.
    exclude = ("credentials_encrypted", "credential_origins", "pending_origin")
    # Retiring checks the agent's tasks and wipes its credentials (services.agents): the
    # agent page and ``manage.py agents retire`` do it; here it is only shown.
    readonly_fields = ("retired_at", "retired_by")
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}

    def save_model(self, request: HttpRequest, obj: Agent, form, change: bool) -> None:  # type: ignore[no-untyped-def]
        """Only the fields the form changed: a whole-row save wrote back the credentials, their
        origins and the card as read at the start of the request, undoing a credential change
        (a leaked token cleared), an approval or a card refresh made meanwhile."""
        if not change:
            obj.save()
            return
        changed = [name for name in form.changed_data if name in form.fields]
        if changed:
            obj.save(update_fields=changed)


class ViewOnly:
    """View permission only: no add, change or delete, whoever asks."""

    def has_add_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False


class ReadOnlyAdmin(ViewOnly, admin.ModelAdmin):
    pass


class ReadOnlyInline(ViewOnly, admin.TabularInline):
    extra = 0


@admin.register(RemoteTask)
class RemoteTaskAdmin(ReadOnlyAdmin):
    list_display = (
        "pk",
        "agent",
        "remote_id",
        "title",
        "phase",
        "state",
        "watcher_status",
        "updated_at",
    )
    list_filter = ("state", "phase", "watcher_status", "agent")
    search_fields = ("remote_id", "title", "context_id")
    raw_id_fields = ("agent", "started_by")
    show_full_result_count = False  # no COUNT(*) over a huge table
    # The message waiting to be sent, as the agent gets it: values typed into password fields
    # included (the log and the pages keep it with them hidden).
    exclude = ("outbox",)


@admin.register(TaskEvent)
class TaskEventAdmin(ReadOnlyAdmin):
    list_display = ("task", "seq", "kind", "channel", "state_after", "received_at")
    list_filter = ("kind", "channel")
    raw_id_fields = ("task", "actor")
    show_full_result_count = False


class ArtifactPartInline(ReadOnlyInline):
    model = ArtifactPart


@admin.register(Artifact)
class ArtifactAdmin(ReadOnlyAdmin):
    list_display = ("task", "artifact_id", "name", "part_count", "complete", "updated_at")
    raw_id_fields = ("task",)
    inlines = [ArtifactPartInline]


@admin.register(ConversationMessage)
class ConversationMessageAdmin(ReadOnlyAdmin):
    list_display = ("task", "message_id", "role", "seq", "created_at")
    raw_id_fields = ("task",)


@admin.register(OperatorAction)
class OperatorActionAdmin(ReadOnlyAdmin):
    list_display = ("action", "task", "agent", "actor", "outcome", "created_at")
    list_filter = ("action",)
    raw_id_fields = ("task", "agent", "actor")


@admin.register(Surface)
class SurfaceAdmin(ReadOnlyAdmin):
    """A2UI surfaces are folded from the log like the rest of the snapshot: view only."""

    list_display = ("task", "surface_id", "version", "ready", "deleted", "problem", "updated_seq")
    list_filter = ("version", "ready", "deleted")
    raw_id_fields = ("task", "action_by")
